"""A new image or checkpoint reaching the fleet as a rollout (`rollout_job`).

Short wiring: `runbook.rollout.survey` puts the new version onto every node first and says who
runs what; `core.rollout` plans the waves, runs them and judges each node; the node steps are
`runbook.rollout_waves.WaveSteps` (the deploy keeping the previous version, the bench gate, revert,
finish); this module records each step. Progress is an observation on `fleet_rollout` after every
step (the asset's Events tab: which node runs which version, which wave runs); each deploy and
bench is also recorded on its node's node_deployment / bench_results partition.
"""


from collections import Counter
from typing import Any

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import fail, record_bench_rotation, record_rotation, retry_unreachable, step_session
from spark_pipelines.assets.bench_metadata import bench_metadata
from spark_pipelines.assets.metadata import deploy_metadata, table
from spark_pipelines.runbook import rollout_waves as waves
from spark_pipelines.runbook.bench import Benched
from spark_pipelines.runbook.deploy import NodeDeployed
from spark_pipelines.runbook.distribution import distribution_payload
from spark_pipelines.core import steps
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import baseline
from spark_pipelines.core import rollout as core
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import rollout as node_rollout
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.state import records


class RolloutConfig(dg.Config):
    bench_gate: bool = Field(default=True, description="Bench every node after its deploy and gate it on the floor, "
                                                       "the MTP acceptance floor and the fleet's baseline; off: "
                                                       "health and the smoke test only.")


def rollout_definitions(fleet) -> dg.Definitions:
    retrying = retry_unreachable(fleet.ssh)
    cv = code_versions(fleet)

    @dg.asset(
        group_name="3_nodes",
        kinds={"docker", "vllm"},
        pool=steps.DRAIN_POOL,  # it drains and benches node after node: never beside a bench
        # A rebuilt checkpoint or image reaches the fleet as this rollout (the `rollout` sensor).
        automation_condition=dg.AutomationCondition.eager(),
        description="The build host's checkpoint and image onto the serving fleet as a rollout: fanned out to "
                    "every node, then a canary and waves of at most rollout.max_unavailable nodes, each node "
                    "deployed (its previous version kept), health-checked and benched against the floors and "
                    "the fleet's baseline. A failed gate stops the rollout and puts that node back on its "
                    "previous version. Progress: this asset's observations (Events tab).",
    )
    @retrying
    def fleet_rollout(context: dg.AssetExecutionContext, config: RolloutConfig, ssh: FleetSSH,
                      litellm: LiteLLMGateway, mtp_weights: Checkpoint, serving_image: BuiltImage):
        s = step_session(context, ssh, litellm)
        f = s.fleet
        log = context.log
        run_id = context.run.run_id
        gw = litellm.host()
        recorded = _Records(context, gw, cv)

        # 0. What a dead run (a killed rollout's deploy or bench) left on a node, finished first.
        for line in node_rollout.finish_dead_runs(s, log, run_id=run_id):
            log.warning(f"rollout: {line}")
        # 1. The new version onto every node; who runs what, who is skipped, who is in the gateway.
        sv = node_rollout.survey(s, gw, distribution_payload(cv, mtp_weights, serving_image), log, run_id=run_id)
        if sv.unjudged:
            log.warning(f"rollout: {', '.join(sv.unjudged)} already run(s) the new version a dead run deployed and "
                        "never judged: gated now, not deployed again")
        records.record_as_serving(context, f, sv.already_serving, sv.new, cv[steps.NODE_DEPLOYMENT],
                                  serving_image.image_id, mtp_weights.index, run_id)
        if sv.nothing_to_do:
            log.info("no serve node to roll out to: " + "; ".join(f"{n}: {why}" for n, why in sv.skip.items()))
            return dg.MaterializeResult(metadata={"completed": True, "outcome": "nothing to roll out",
                                                  "nodes": table(core.STEP_COLUMNS, _rows(sv.before, sv.skip))})
        try:
            plan = waves.plan(s, sv)
        except core.RolloutRefused as e:
            fail(RunbookError(f"rollout refused, nothing changed: {e}"))
        log.info("rollout plan:\n" + plan.text())

        # 2. The baseline every node is judged against: the fleet on the version most of the
        # rotation runs now (not the newest bench: a canary that failed its gate was benched last).
        serving = Counter(sv.running[n] for n in sv.rotation if n in sv.running).most_common(1)
        benches = [r for n in f.serve_nodes for r in records.recorded_benches(context.instance, n.name)]
        base = baseline.fleet_baseline(benches, identity=serving[0][0] if serving else None)
        log.info(f"baseline on the previous version: {base.text() if base else 'none (no bench that counts)'}")

        def on_progress(event: str, done: list[core.NodeStep]) -> None:
            log.info(f"rollout: {event}")
            records.observe(context, steps.FLEET_ROLLOUT, None, description=event, metadata={
                "event": event, "nodes": table(core.STEP_COLUMNS, core.rows(done)),
                "plan": dg.MetadataValue.md("\n".join(f"- {ln}" for ln in plan.text().splitlines()))})

        steps_on_fleet = waves.WaveSteps(
            s, gw, recorded, mtp_weights, serving_image, cv[steps.NODE_DEPLOYMENT],
            bench_gate=config.bench_gate, against=base, new=sv.new, run_id=run_id, log=log,
            deployed=set(sv.unjudged), passed=set(sv.passed))
        outcome = core.execute(plan, steps_on_fleet, sv.before, on_progress, passed_before=sv.passed)
        meta: dict[str, Any] = {
            "completed": outcome.completed,
            "outcome": outcome.headline(),
            "nodes": table(core.STEP_COLUMNS, core.rows(outcome.steps)),
            "plan": dg.MetadataValue.md("\n".join(f"- {ln}" for ln in plan.text().splitlines())),
            "baseline": base.text() if base else "none",
        }
        if not outcome.completed:
            g = outcome.failed_gate
            assert g is not None
            raise dg.Failure(description=outcome.headline(), metadata={
                "failed_gate": g.gate, "failed_node": g.node, "why": g.why,
                "nodes": table(core.STEP_COLUMNS, core.rows(outcome.steps))})
        return dg.MaterializeResult(metadata=meta)

    rollout_job = dg.define_asset_job(
        steps.ROLLOUT_JOB, selection=dg.AssetSelection.assets(steps.FLEET_ROLLOUT),
        tags={steps.ROLLOUT_TAG: "fleet", steps.BENCH_TAG: "rollout", **max_runtime(fleet, steps.ROLLOUT_JOB)},
        description="Roll the build host's checkpoint and image out to the fleet: fan-out, canary, then waves "
                    "gated by health and bench; a failed gate stops it and puts the node back "
                    "(`spark-pipelines plan` shows the waves first).")
    return dg.Definitions(assets=[fleet_rollout], jobs=[rollout_job])


def _rows(before: dict[str, str], skipped: dict[str, str]) -> list[dict[str, str]]:
    return [{"node": n, "wave": "-", "before": before[n], "now": before[n], "state": "skipped",
             "gate": "", "why": skipped.get(n, "")} for n in before]


class _Records:
    """runbook.rollout_waves.RolloutRecords on the instance: each deploy and bench recorded on its
    node's node_deployment / bench_results partition as those assets' own output (the pins sensor
    and the UI's staleness see the rollout's steps as current), the rotation on the gateway."""

    def __init__(self, context: dg.AssetExecutionContext, gw, cv: dict[str, str]) -> None:
        self.context, self.gw, self.cv = context, gw, cv
        self.run_id = context.run.run_id

    def deployed(self, node: str, d: NodeDeployed) -> None:
        fleet = self.gw.fleet
        records.record_deploy(self.context, node, self.cv[steps.NODE_DEPLOYMENT], d.data_version,
                              {**deploy_metadata(fleet, fleet.node(node), d), keys.ROLLOUT_RUN: self.run_id},
                              launch=d.deployment.fingerprint)

    def benched(self, node: str, b: Benched) -> None:
        record_bench_rotation(self.context, self.gw, b)
        records.record_bench(self.context, node, self.cv[steps.BENCH_RESULTS],
                             {**bench_metadata(self.context, self.gw.fleet, node, b), keys.ROLLOUT_RUN: self.run_id})

    def rotation(self, event: str) -> None:
        record_rotation(self.context, self.gw, event, {})

    def reverted(self, node: str, said: str, why: str) -> None:
        records.observe(self.context, steps.NODE_DEPLOYMENT, node, description=said,
                        metadata={"rolled_back_by_rollout": self.run_id, "why": why[:500]})
