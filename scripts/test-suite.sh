#!/usr/bin/env bash
# The whole suite in two pytest sessions side by side: most of the slow tier waits on simulated
# boots, drains and proxy reloads, not on the CPU, so two sessions on the machine's two cores end in
# a little over the longer one's time instead of the sum (CI: 79 min in one session).
#
#   e2e        tests/e2e: one simulated fleet (test_chain's first deploy first), plus the `make demo`
#              and first-contact tests on fleets of their own; then the two distribution tests that
#              bring up 4 and 8 nodes of their own, and the node pair's (TP=2) module, which
#              deploys both nodes its own way (they balance the two sessions' times)
#   the rest   unit, integration, then the faults (their fleet lives until the session ends)
#
# Each session takes its own simulated-fleet slot (tests/plugins/sim.py), so they share nothing on
# the nodes. `scripts/test-suite.sh -- <pytest args>` or SPARK_TEST_STREAMS=1 runs one session.
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [[ "${1:-}" == "--" ]]; then shift; exec "$py" -m pytest "$@"; fi
if [[ "${SPARK_TEST_STREAMS:-2}" == 1 ]]; then exec "$py" -m pytest; fi

own_fleets=(tests/integration/test_distribution_tree.py tests/integration/test_fleet_of_eight.py
            tests/integration/test_pair.py)
logs=$(mktemp -d)
e2e_pid=
trap '[[ -n $e2e_pid ]] && kill -- -"$e2e_pid" 2>/dev/null; rm -rf "$logs"' EXIT
# The e2e session in its own process group, its output kept for the end (read it live: tail -f).
set -m
"$py" -m pytest tests/e2e "${own_fleets[@]}" -p no:cacheprovider >"$logs/e2e.log" 2>&1 &
e2e_pid=$!
set +m
echo "test-suite: e2e session $e2e_pid, its output: $logs/e2e.log (printed when it ends)"
"$py" -m pytest tests/unit tests/integration "${own_fleets[@]/#/--ignore=}" tests/faults
rest=$? rest_s=$SECONDS
wait "$e2e_pid"
e2e=$?
e2e_pid=
echo
echo "================================ e2e session ================================="
cat "$logs/e2e.log"
echo
echo "test-suite: unit+integration+faults exit $rest after ${rest_s}s, e2e exit $e2e; ${SECONDS}s in all"
[[ $rest == 0 && $e2e == 0 ]]
