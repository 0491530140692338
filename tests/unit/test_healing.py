"""core/healing.py: the healing policies, their budgets and backoff, and the gateway reconcile plan."""

import time

import pytest

from spark_pipelines.core import healing
from spark_pipelines.core.fleet_settings import HealthSettings
from spark_pipelines.core.health import ADVICE, NodeVerdict
from spark_pipelines.core.healing import NodeMemory, NodeState, decide, reconcile

S = HealthSettings()  # 3 redeploys in 6 h, 10 min backoff doubling, 2 sweeps, bench max 30 min
T0 = 2_000_000_000.0


def v(name, node="spark2"):
    return NodeVerdict(node, name, ("evidence",), ADVICE[name])


def sweeps(name, memory=None, *, start=T0, every=60.0, n=1, **kw):
    """n sweeps of the same verdict; returns (decisions, memory)."""
    out = []
    for i in range(n):
        d = decide(v(name), memory, S, now=start + i * every, **kw)
        memory = d.memory
        out.append(d)
    return out, memory


def actions(decisions):
    return [d.action for d in decisions if d.action is not None]


def test_engine_down_waits_for_two_sweeps_then_redeploys_once():
    ds, m = sweeps("engine-down", n=4)
    acts = actions(ds)
    assert ds[0].action is None and "1 of 2 sweeps" in ds[0].note
    assert len(acts) == 1 and acts[0].kind == "redeploy" and acts[0].job == "deploy_node_job"
    assert acts[0].run_key == f"heal-spark2-{int(T0)}-redeploy1"
    assert "redeploy 1 of 3 in 6 h" in acts[0].reason
    assert "backoff" in ds[2].note and "9 min from now" in ds[2].note  # 10 min after the first one


def test_the_fourth_failure_in_the_window_is_not_redeployed():
    m, keys, now = None, [], T0
    for episode in range(4):
        ds, m = sweeps("engine-down", m, start=now, n=2)
        keys += [(a.kind, a.run_key) for a in actions(ds)]
        if episode < 3:
            _, m = sweeps("healthy", m, start=now + 120)  # the redeploy restored it: the episode ends
        now += 3 * 3600 / 4 + (episode + 1) * 1200  # backoff respected (10, 20, 40 min), inside 6 h
    kinds = [k for k, _ in keys]
    assert kinds == ["redeploy", "redeploy", "redeploy", "quarantine"], keys
    assert len({k for _, k in keys}) == 4  # every episode has its own keys
    q = next(a for a in actions(ds) if a.kind == "quarantine")
    assert q.kind == "quarantine" and q.job == "quarantine_job"
    assert "restart budget spent: 3 redeploy(s) in the last 6 h" in q.reason
    assert q.config == {"verdict": "engine-down", "reason": q.reason}


def test_the_window_slides_old_redeploys_out():
    m = NodeMemory(redeploys=[T0 - 7 * 3600, T0 - 6.5 * 3600, T0 - 3600])
    ds, m = sweeps("engine-down", m, n=2)
    a = actions(ds)[0]
    assert a.kind == "redeploy" and "redeploy 2 of 3" in a.reason and len(m.redeploys) == 2


def test_backoff_doubles():
    assert [healing.backoff_s(S, n) for n in range(4)] == [0, 600, 1200, 2400]
    m = NodeMemory(redeploys=[T0 - 3000, T0 - 900])  # 2 in the window, last one 15 min ago: 20 min wait
    ds, m = sweeps("engine-down", m, n=2)
    assert not actions(ds) and "4 min from now" in ds[-1].note
    ds, m = sweeps("engine-down", m, start=T0 + 360)
    assert actions(ds)[0].kind == "redeploy"


@pytest.mark.parametrize("name", ["crash-loop", "residue"])
def test_crash_loop_and_residue_quarantine_never_relaunch(name):
    ds, m = sweeps(name, n=5)
    acts = actions(ds)
    assert [a.kind for a in acts] == ["quarantine"]
    assert acts[0].config["verdict"] == name and "relaunching cannot help" in acts[0].reason
    if name == "residue":
        assert "reboot the node" in acts[0].reason
    assert not m.redeploys


def test_a_quarantined_node_gets_no_action():
    ds, _ = sweeps("engine-down", n=3, quarantined="residue: reboot the node")
    assert not actions(ds) and "quarantined (residue: reboot the node)" in ds[-1].note


def test_a_released_node_whose_engine_is_down_is_redeployed_with_a_new_budget():
    """The 60-minute soak: spark6 spent its restart budget, was quarantined, and the operator
    released it with its engine still down; the sweep then said "quarantine already requested in
    this episode" for ever. A release starts a new episode: redeployed, with the whole budget."""
    m, now = None, T0
    for episode in range(4):  # three redeploys, then the quarantine
        ds, m = sweeps("engine-down", m, start=now, n=2)
        if episode < 3:
            _, m = sweeps("healthy", m, start=now + 120)
        now += 3 * 3600 / 4 + (episode + 1) * 1200
    assert actions(ds)[-1].kind == "quarantine"
    held, m = sweeps("engine-down", m, start=now + 60, n=2, quarantined="engine-down: restart budget spent")
    assert not actions(held) and m.held
    after, m = sweeps("engine-down", m, start=now + 300, n=2)
    acts = actions(after)
    assert [a.kind for a in acts] == ["redeploy"], [d.note for d in after]
    assert "redeploy 1 of 3 in 6 h" in acts[0].reason and not m.held
    assert NodeMemory.from_json(m.to_json()) == m
    # Without a release, the episode's quarantine stands.
    again, _ = sweeps("engine-down", held[-1].memory, start=now + 300, n=2,
                      quarantined="engine-down: restart budget spent")
    assert not actions(again)


@pytest.mark.parametrize("name", ["unreachable", "wedged", "starting", "unknown"])
def test_recorded_only(name):
    ds, m = sweeps(name, n=4)
    assert not actions(ds)
    assert m.failing == (4 if name == "unreachable" else 0)
    if name == "wedged":
        assert "wedge_watch" in ds[-1].note


def test_starting_does_not_end_an_episode():
    ds, m = sweeps("engine-down", n=2)
    since = m.since
    _, m = sweeps("starting", m, start=T0 + 200, n=3)
    assert m.since == since and m.done == ["redeploy1"]
    _, m = sweeps("healthy", m, start=T0 + 600)
    assert m.since is None and m.done == [] and m.redeploys  # the budget outlives the episode


def test_regressed_confirm_redeploy_verify_rollback():
    ds, m = sweeps("regressed", n=3, benches=4)
    acts = actions(ds)
    assert [a.kind for a in acts] == ["bench"] and acts[0].job == "bench_job"
    assert acts[0].run_key.endswith("-bench-confirm") and "waiting for the confirming bench" in ds[-1].note
    ds, m = sweeps("regressed", m, start=T0 + 600, n=2, benches=5)  # the confirming bench is slow too
    acts = actions(ds)
    assert [a.kind for a in acts] == ["redeploy"] and m.stage == "redeployed"
    # A serving node's plain redeploy would skip: this one relaunches on a fresh JIT cache.
    assert acts[0].config == {"fresh_jit_cache": True}
    ds, m = sweeps("regressed", m, start=T0 + 700, benches=5, started_at=T0 + 100)  # not the new container yet
    assert not actions(ds) and "waiting for the redeploy" in ds[-1].note
    ds, m = sweeps("regressed", m, start=T0 + 1500, n=2, benches=5, started_at=T0 + 1000)
    assert [a.run_key.rsplit("-", 2)[-2:] for a in actions(ds)] == [["bench", "verify"]]
    ds, m = sweeps("regressed", m, start=T0 + 2500, n=3, benches=6, started_at=T0 + 1000)
    acts = actions(ds)
    assert [a.kind for a in acts] == ["rollback"] and acts[0].job == "quarantine_job"
    assert "previous image" in acts[0].reason and acts[0].config["verdict"] == "regressed"


def test_a_confirming_bench_that_is_fine_ends_the_episode():
    ds, m = sweeps("regressed", n=2, benches=4)
    _, m = sweeps("healthy", m, start=T0 + 900, benches=5)
    assert m.stage is None and m.since is None


def test_memory_survives_json_and_old_cursors():
    ds, m = sweeps("engine-down", n=2)
    assert NodeMemory.from_json(m.to_json()) == m
    assert NodeMemory.from_json(3) == NodeMemory()
    old = NodeMemory.from_json({"failures": 2, "since": 1000, "requested": True})
    assert old.since == 1000.0 and old.streak == 0 and old.done == []
    assert NodeMemory.from_json({"redeploys": ["x", 5], "streak": True}).redeploys == [5.0]


# ------------------------------------------------------------------ reconcile

def note(reason, ago):
    return f"{reason} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(T0 - ago))}"


OK = NodeState("healthy", serving=True)


def plan(nodes, rotation, drains=None, floor=1):
    return reconcile(nodes, rotation, drains or {}, settings=S, min_in_rotation=floor, now=T0)


def test_drained_at_reads_the_gateways_note():
    assert healing.drained_at(note("drained", 60)) == T0 - 60
    assert healing.drained_at("drained") is None


def test_two_failed_sweeps_take_a_node_out_dead():
    p = plan({"spark1": OK, "spark2": NodeState("engine-down", failing=2)}, ["spark1", "spark2"])
    assert [(m.node, m.dead) for m in p.take_out] == [("spark2", True)] and not p.put_back
    assert "engine-down on 2 sweeps in a row" in p.take_out[0].reason
    p = plan({"spark1": OK, "spark2": NodeState("unreachable", failing=1)}, ["spark1", "spark2"])
    assert p.empty


def test_a_dead_node_goes_even_below_the_floor_a_serving_one_does_not():
    nodes = {"spark1": NodeState("unreachable", failing=3), "spark2": NodeState("crash-loop", failing=2)}
    p = plan(nodes, ["spark1", "spark2"], floor=1)
    assert {m.node for m in p.take_out} == {"spark1", "spark2"}
    nodes = {"spark1": OK, "spark2": NodeState("healthy", serving=True, quarantined="wedged: cold drain")}
    p = plan(nodes, ["spark2"], drains={"spark1": note("drained", 60)}, floor=1)
    assert not p.take_out and "spark2 stays in" in p.describe() and "min_in_rotation=1" in p.describe()


def test_quarantined_and_unpromoted_are_out_healthy_promoted_are_in():
    nodes = {"spark1": NodeState("healthy", serving=True, quarantined="residue"),
             "spark2": OK, "spark3": NodeState("healthy", serving=True, promoted=False)}
    p = plan(nodes, ["spark1", "spark3"])
    assert [m.node for m in p.put_back] == ["spark2"]
    assert [m.node for m in p.take_out] == ["spark1", "spark3"]
    assert p.to_config()["take_out"][0] == {"node": "spark1", "reason": "quarantined: residue", "dead": False}


def test_a_recent_bench_drain_is_left_alone_an_old_one_undone():
    nodes = {"spark1": OK, "spark2": OK}
    p = plan(nodes, ["spark1"], {"spark2": note("drained", 10 * 60)})
    assert p.empty and "a bench may still be running" in p.describe()
    p = plan(nodes, ["spark1"], {"spark2": note("drained", 31 * 60)})
    assert [m.node for m in p.put_back] == ["spark2"] and "31 min ago" in p.put_back[0].reason
    # A drain these policies made is undone as soon as the node is healthy again.
    p = plan(nodes, ["spark1"], {"spark2": note("health: engine-down on 2 sweeps in a row", 60)})
    assert [m.node for m in p.put_back] == ["spark2"]
    # Not healthy yet: stays out.
    p = plan({"spark1": OK, "spark2": NodeState("starting")}, ["spark1"], {"spark2": note("drained", 3600)})
    assert p.empty


def test_a_released_quarantine_is_the_reason_the_node_goes_back():
    """Issue 35, item 10: gateway_reconcile_job after a manual release said "the health drain is over"."""
    p = plan({"spark1": OK, "spark2": OK}, ["spark1"], {"spark2": note("health: quarantined (manual)", 600)})
    (back,) = p.put_back
    assert back.reason.startswith("its quarantine (manual) was released and it is healthy and promoted, out since ")
    assert "health drain" not in p.describe()
    p = plan({"spark1": OK, "spark2": OK}, ["spark1"], {"spark2": note("health: engine-down on 2 sweeps in a row", 60)})
    assert p.put_back[0].reason.startswith("healthy and promoted again after the health policy took it out "
                                           "(engine-down on 2 sweeps in a row), out since ")
    p = plan({"spark1": OK, "spark2": OK}, ["spark1"])  # out with no drain note: the gateway step left it out
    assert p.put_back[0].reason == "healthy and promoted, and out of the gateway config"


# ------------------------------------------------------------------ the residue quarantine's preflight

def preflight_report(free_gib, baseline):
    from spark_pipelines.core.preflight import Observations, evaluate

    obs = Observations(free_gib=free_gib, total_gib=121.6, gpu_state="idle", gpu_holder_pids=[], persistenced_pids=[],
                       earlyoom_installed=False, running_exporters=[], disk_free_gib=500, page_cache_flushed=True)
    return evaluate("spark2", obs, gmu=0.75, max_gmu=0.87, profile_total_gib=121.6, min_disk_gib=100,
                    residue_baseline_gib=baseline)


def test_a_residue_quarantine_blocks_the_preflight_until_memory_is_back():
    blocked = preflight_report(96.5, 106.0)
    residue = [c for c in blocked.checks if c.name == "residue"]
    assert not blocked.passed and residue[0].status == "fail"
    assert "reboot the node" in residue[0].fix and "106.00 GiB" in residue[0].detail
    back = preflight_report(105.5, 106.0)  # within one failed start's residue of the baseline: noise
    assert back.passed and [c.status for c in back.checks if c.name == "residue"] == ["ok"]
    # Not quarantined: no residue check (the memory gate alone decides, as before).
    assert "residue" not in [c.name for c in preflight_report(96.5, None).checks]


def test_engine_figures_from_two_reads():
    m1 = {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 1, "vllm:kv_cache_usage_perc": 0.25,
          "vllm:generation_tokens_total": 1000, "vllm:spec_decode_num_draft_tokens_total": 200,
          "vllm:spec_decode_num_accepted_tokens_total": 180}
    m2 = {**m1, "vllm:generation_tokens_total": 1600, "vllm:spec_decode_num_draft_tokens_total": 500,
          "vllm:spec_decode_num_accepted_tokens_total": 420}
    one = healing.engine_figures(m1)
    assert {k: v for k, v in one.items() if k != "engine"} == {
        "requests_running": 2, "requests_waiting": 1, "kv_cache_usage_pct": 25.0, "mtp_acceptance_pct": 90.0}
    two = healing.engine_figures(m2, m1, 60.0)
    assert two["generation_tok_s"] == 10.0 and two["mtp_acceptance_pct"] == 80.0
    assert two["engine"] == ("2 running / 1 waiting now; 10 tok/s generated over the last 60 s; "
                             "MTP acceptance 80% over the last 60 s; KV cache 25% used")
    assert healing.engine_figures(None) == {}


def test_an_idle_nodes_figures_do_not_contradict_its_evidence():
    """Issue 35, item 9: `mtp_acceptance 1` beside "95.7%" in the evidence (a handful of tokens since
    the last sweep against the lifetime counters), and 1.43 tok/s on an idle node without a word."""
    from spark_pipelines.core.health import Observation, judge

    life = {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:generation_tokens_total": 90000,
            "vllm:spec_decode_num_draft_tokens_total": 60000, "vllm:spec_decode_num_accepted_tokens_total": 57420}
    later = {**life, "vllm:generation_tokens_total": 90086, "vllm:spec_decode_num_draft_tokens_total": 60012,
             "vllm:spec_decode_num_accepted_tokens_total": 57432}
    fig = healing.engine_figures(later, life, 60.0)
    assert fig["mtp_acceptance_pct"] == 95.7  # 12 drafted tokens say nothing: the lifetime figure, as the evidence
    assert "MTP acceptance 95.7% since the engine started" in fig["engine"]
    assert fig["generation_tok_s"] == 1.43
    assert "1.43 tok/s generated over the last 60 s (short requests between sweeps" in fig["engine"]
    assert "0 running / 0 waiting now" in fig["engine"]
    evidence = "; ".join(judge(Observation(node="spark1", probed_at=T0, ssh_ok=True, health_ok=True,
                                           metrics=later)).evidence)
    assert "MTP acceptance 95.7% since the engine started" in evidence


def test_the_cursor_keeps_what_differs_from_a_fresh_memory():
    """Issue 35, item 12: node_health's cursor was ~1,300 characters of JSON on the sensor's page."""
    fresh = healing.NodeMemory()
    assert fresh.to_json() == {}
    m = healing.NodeMemory(verdict="healthy", streak=3, earlier={"probed_at": 1796611962.123456, "ssh_ok": True,
                                                                  "started_at": None, "metrics": {}})
    assert m.to_json() == {"verdict": "healthy", "streak": 3, "earlier": {"probed_at": 1796611962, "ssh_ok": True,
                                                                          "metrics": {}}}
    back = healing.NodeMemory.from_json(m.to_json())
    assert back.verdict == "healthy" and back.streak == 3 and back.failing == 0 and back.since is None


def test_a_dead_deploy_is_repaired_at_once_whatever_the_verdict_and_outside_the_budget():
    """A deploy journal whose run no longer holds the node's lease: its repair is requested on the
    first sweep that sees it, once per dead run (the run key), with no redeploy counted."""
    for name in ("engine-down", "healthy", "starting"):
        d = decide(v(name), None, S, now=T0, interrupted="0123456789abcdef")
        assert d.action is not None and d.action.job == "deploy_node_job" and d.action.kind == "redeploy"
        assert d.action.run_key == healing.repair_key("spark2", "0123456789abcdef") == "repair-spark2-01234567"
        assert "run 01234567 died on spark2" in d.note and d.memory.redeploys == []
    # A quarantine does not hold the repair back (the journal must be finished), and says so.
    d = decide(v("engine-down"), None, S, now=T0, interrupted="feed", quarantined="crash-loop: x")
    assert d.action is not None and "stays quarantined (crash-loop: x)" in d.note
    # Without a dead journal the ordinary policy: nothing on the first sweep.
    assert decide(v("engine-down"), None, S, now=T0).action is None


def test_a_dead_procedure_is_finished_by_a_run_of_its_own_job_once_per_dead_run():
    """Phase 0's reboot, a bench's drain, a newcomer, a cold drain a dead run left (runbook/journal.py):
    the procedure's own job, keyed by the dead run, whatever the verdict and at once."""
    from spark_pipelines.core import steps

    for proc, job in steps.FINISHED_BY.items():
        u = healing.Unfinished(proc, "0123456789abcdef", "drained", f"the {proc} of run 01234567")
        d = decide(v("healthy"), None, S, now=T0, unfinished=u)
        assert d.action is not None and d.action.job == job and d.action.kind == "finish"
        assert d.action.run_key == f"finish-spark2-{proc}-01234567" and "01234567" in d.action.reason


def test_a_node_a_dead_reboot_left_unreachable_is_quarantined_with_the_hard_reset_advice():
    """A node that did not come back from a dead run's Phase 0 reboot cannot be finished over SSH;
    a dead cold drain's own rerun turns the smart plug on, so it is requested as the others."""
    u = healing.Unfinished("node_os", "0123456789abcdef", "rebooting", "the node os of run 01234567")
    d = decide(v("unreachable"), None, S, now=T0, unfinished=u)
    assert d.action.job == "quarantine_job" and d.action.config["verdict"] == "unreachable"
    assert "hard reset" in d.action.config["reason"] and "node_os_job" in d.action.config["reason"]
    cold = healing.Unfinished("cold_drain", "0123456789abcdef", "power-off", "the cold drain of run 01234567")
    assert decide(v("unreachable"), None, S, now=T0, unfinished=cold).action.job == "cold_drain_job"


def test_a_dead_deploy_is_repaired_before_another_procedure():
    u = healing.Unfinished("bench", "0123456789abcdef", "drained", "the bench of run 01234567")
    d = decide(v("engine-down"), None, S, now=T0, interrupted="fedcba9876543210", unfinished=u)
    assert d.action.job == "deploy_node_job" and d.action.run_key == "repair-spark2-fedcba98"


def test_a_node_with_a_procedure_in_flight_is_not_put_back():
    nodes = {"spark1": NodeState("healthy", serving=True),
             "spark2": NodeState("healthy", serving=True, busy="the bench of run 01234567 (phase drained)")}
    plan = reconcile(nodes, ["spark1"], {"spark2": "bench (run 01234567) since 2026-01-01T00:00:00Z"},
                     settings=S, min_in_rotation=1, now=T0)
    assert plan.put_back == () and any("bench of run 01234567" in h for h in plan.held), plan
