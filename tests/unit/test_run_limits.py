"""Each long job carries `dagster/max_runtime` covering its own worst case (issue 34, item 6): the
team instance's run monitoring must never cancel a GX10's download and builds, or a four-node
rollout of a new image, while it is still inside the code's own bounds. The worst cases here are
written out from the bounds where they live, apart from runbook/run_limits.py's sums."""

from __future__ import annotations

import copy

import pytest
import yaml
from dagster._core.storage.tags import MAX_RUNTIME_SECONDS_TAG

from spark_pipelines.core import node_os as os_core
from spark_pipelines.core import remote, steps
from spark_pipelines.core.fleet import parse_fleet
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources import gateway
from spark_pipelines.resources.transfer import DIGEST_TIMEOUT_S
from spark_pipelines.runbook import bench, node_os, run_limits, transaction
from spark_pipelines.cli.team.instance import TEMPLATE

INSTANCE_DEFAULT = yaml.safe_load(TEMPLATE.read_text())["run_monitoring"]["max_runtime_seconds"]
SHORT_JOBS = {steps.GATEWAY_JOB, steps.QUARANTINE_JOB, steps.RELEASE_JOB, steps.RECONCILE_JOB,
              steps.WEDGE_CAPTURE_JOB, steps.SUMMARY_JOB}


def four_nodes(seed_data) -> dict:
    data = copy.deepcopy(seed_data)
    serve = data["nodes"][1]
    data["nodes"] += [dict(copy.deepcopy(serve), name=f"spark{i}", host=f"10.0.0.{10 + i}") for i in (3, 4)]
    return data


def job_tags(tmp_path, data) -> tuple[object, dict[str, float]]:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    defs = build_definitions(str(path))
    return parse_fleet(data), {j.name: float(j.tags[MAX_RUNTIME_SECONDS_TAG])
                               for j in defs.resolve_all_job_defs() if MAX_RUNTIME_SECONDS_TAG in j.tags}


def deploy_s(f, node) -> float:
    return (f.rollout.deploy_wait_s + f.gateway.in_flight_wait_s + f.launch_for(node).health_timeout_s
            + transaction.ROLLBACK_HEALTH_S + 2 * gateway.change_limit_s())


def bench_s(f) -> float:
    return gateway.ROTATION_WAIT_S + f.gateway.in_flight_wait_s + f.health.bench_max_s + bench.QUALITY_MAX_S


COPY_S = remote.COPY_TIMEOUT_S + remote.IMAGE_COPY_TIMEOUT_S + DIGEST_TIMEOUT_S


def test_the_tag_is_the_one_dagsters_run_monitoring_reads():
    assert run_limits.MAX_RUNTIME_TAG == MAX_RUNTIME_SECONDS_TAG == "dagster/max_runtime"


@pytest.mark.parametrize("fleet_of", [lambda d: d, four_nodes], ids=["seed", "four nodes"])
def test_every_long_job_carries_a_limit_covering_its_worst_case(tmp_path, seed_data, fleet_of):
    f, tags = job_tags(tmp_path, fleet_of(seed_data))
    serve = f.serve_nodes
    worst = {
        # Steps 0-4: the download, two checkpoint builds, two image builds (the old 9000 s fell below).
        steps.BUILD_JOB: remote.DOWNLOAD_TIMEOUT_S + 2 * remote.CHECKPOINT_BUILD_TIMEOUT_S
        + 2 * remote.IMAGE_BUILD_TIMEOUT_S + 3 * DIGEST_TIMEOUT_S,
        steps.DEPLOY_JOB: max(COPY_S + deploy_s(f, n) + remote.COPY_TIMEOUT_S for n in serve),
        steps.BENCH_JOB: bench_s(f),
        # One node after another: each deployed and benched, the fan-out before them.
        steps.ROLLOUT_JOB: COPY_S * (len(serve) - 1) + sum(deploy_s(f, n) + bench_s(f) for n in serve),
        steps.NODE_OS_JOB: os_core.most_commands(node_os.choices(f)) * node_os.CHANGE_TIMEOUT_S
        + f.node_os.reboot_ssh_timeout_s + f.cold_drain.engine_timeout_s,
        steps.ADD_NODE_JOB: f.node_os.reboot_ssh_timeout_s + f.cold_drain.engine_timeout_s + COPY_S
        + max(deploy_s(f, n) for n in serve) + bench_s(f),
        steps.COLD_DRAIN_JOB: f.cold_drain.power_down_timeout_s + f.cold_drain.operator_timeout_s
        + f.cold_drain.engine_timeout_s + bench_s(f),
        steps.DISTRIBUTE_JOB: COPY_S * (len(serve) - 1),
        steps.ADOPT_JOB: DIGEST_TIMEOUT_S * (len(serve) + 1),
        steps.AB_JOB: max(3 * deploy_s(f, n) for n in serve) + 2 * f.health.bench_max_s,
    }
    for job, seconds in worst.items():
        assert job in tags, f"{job} has no {MAX_RUNTIME_SECONDS_TAG} tag"
        assert tags[job] >= seconds, f"{job}: limit {tags[job]:.0f} s < its worst case {seconds:.0f} s"
    assert tags[steps.BUILD_JOB] > INSTANCE_DEFAULT and tags[steps.ROLLOUT_JOB] > INSTANCE_DEFAULT
    assert set(tags) == set(worst)  # the short jobs keep the instance-wide default
    defs = build_definitions("fleets/seed.yaml")
    assert SHORT_JOBS <= {j.name for j in defs.resolve_all_job_defs()}


def test_the_limits_follow_the_fleet_file_and_the_fleet_size(tmp_path, seed_data):
    f2, two = job_tags(tmp_path, seed_data)
    f4, four = job_tags(tmp_path, four_nodes(seed_data))
    # Two more serve nodes: each deployed and benched in turn, and two more receivers of the fan-out.
    assert four[steps.ROLLOUT_JOB] - two[steps.ROLLOUT_JOB] >= 2 * (deploy_s(f4, f4.serve_nodes[-1]) + bench_s(f4))
    slower = copy.deepcopy(seed_data)
    slower["rollout"]["deploy_wait_s"] = seed_data["rollout"]["deploy_wait_s"] + 1000
    _, waits = job_tags(tmp_path, slower)
    assert waits[steps.DEPLOY_JOB] - two[steps.DEPLOY_JOB] == pytest.approx(1000, abs=1)
    assert waits[steps.ROLLOUT_JOB] - two[steps.ROLLOUT_JOB] == pytest.approx(1000 * len(f2.serve_nodes), abs=1)
    assert waits[steps.BENCH_JOB] == two[steps.BENCH_JOB]


def test_the_instance_default_stays_for_the_short_jobs():
    # A hung gateway write or quarantine still ends; the long jobs say their own.
    assert 3600 <= INSTANCE_DEFAULT <= 3 * 3600
