"""First contact: `adopt_job` records a fleet built by hand as spark-pipelines' own, changing
nothing that serves (runbook/adoption.py).

One runbook call, then recording: every step found as the pins say (adopted) or already the
tool's (current) is recorded on its asset, with the code version and data version the step itself
would record and its inputs' provenance, so the UI shows the fleet as current, `pins_changed`
sees no change and the sensors work from the first tick. With `check: true` nothing is written
anywhere: the table says what the chain would do (the CLI's `adopt --check` and `plan --live`).
"""


import time
from typing import Any

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import retry_unreachable, step_session
from spark_pipelines.assets.metadata import table
from spark_pipelines.core import adoption as core
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions, launch_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.hub import ModelHub
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook.adoption import adopt_fleet
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.state import markers, records

COLUMNS = (
    ("node", "string", "the build host, a serve node, or the gateway"),
    ("step", "string", "the asset"),
    ("action", "string", "current | adopt | build | relaunch | differs"),
    ("why", "string", "what was found"),
    ("differences", "string", "field by field, where the live fleet and the fleet file disagree"),
)
# Each step's upstream steps as the asset graph declares them: the provenance its record carries.
INPUTS: dict[str, tuple[str, ...]] = {
    steps.BASE_MODEL: (),
    steps.HYBRID_CHECKPOINT: (steps.BASE_MODEL,),
    steps.MTP_WEIGHTS: (steps.BASE_MODEL, steps.HYBRID_CHECKPOINT),
    steps.BASE_IMAGE: (),
    steps.SERVING_IMAGE: (steps.BASE_IMAGE,),
    steps.NODE_ARTIFACTS: (steps.MTP_WEIGHTS, steps.SERVING_IMAGE),
    steps.NODE_DEPLOYMENT: (steps.NODE_ARTIFACTS, steps.NODE_LAUNCH),
}
PER_NODE = (steps.NODE_LAUNCH, steps.NODE_ARTIFACTS, steps.NODE_DEPLOYMENT)


class AdoptConfig(dg.Config):
    check: bool = Field(default=False, description="Say what the chain would do against the live fleet (skip / "
                                                   "adopt / build / relaunch / differs, and why); write nothing.")
    nodes: list[str] = Field(default=[], description="Serve nodes to adopt (default: every one); the build host and "
                                                     "the gateway are always read.")


def hash_figures(findings: list[core.Finding]) -> dict[str, Any]:
    """What hashing the nodes' copies took (each node on its own disk, at once): bytes, the
    longest hash and its rate."""
    done = [f.facts for f in findings if f.facts.get("hash_bytes")]
    if not done:
        return {}
    longest = max(done, key=lambda d: d.get("hash_seconds", 0))
    return {"hashed_bytes": sum(int(d["hash_bytes"]) for d in done), "hashed_nodes": len(done),
            "hash_seconds_longest": longest.get("hash_seconds", 0),
            "hash_mib_per_s_longest": longest.get("hash_mib_per_s", 0)}


def rows(findings: list[core.Finding]) -> list[dict[str, str]]:
    return [{"node": f.node, "step": f.step, "action": f.action, "why": f.why,
             "differences": "; ".join(f.differences)} for f in findings]


def record(context: dg.AssetExecutionContext, cv: dict[str, str], launch: dict[str, str], f: core.Finding) -> bool:
    """The adopted (or current) step as its asset would record it; False when there is nothing to record.
    `launch`: core.pins.launch_versions, what an adopted or current deployment serves (it was compared
    with the node's launch spec)."""
    if f.action not in (core.ADOPT, core.CURRENT) or f.step not in INPUTS or not f.facts.get("data_version"):
        return False
    partition = f.node if f.step in PER_NODE else None
    if f.step == steps.NODE_DEPLOYMENT:  # its provenance points at the node's launch, as a deploy's does
        records.observe_launch(context, f.node, launch[f.node])
    records.record_step(context, f.step, partition, cv[f.step], str(f.facts["data_version"]),
                        {"adopted": f.action == core.ADOPT, "skipped": True, "found": f.why},
                        description=f"adopted from the live fleet: {f.why}",
                        inputs={i: (f.node if i in PER_NODE else None) for i in INPUTS[f.step]})
    return True


def adoption_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)
    launch = launch_versions(fleet)

    @dg.asset(
        name=steps.FLEET_ADOPTION,
        group_name="0_fleet",
        kinds={"ssh", "docker", "litellm"},
        description="First contact with a fleet built by hand: every step of the chain read on the live fleet and "
                    "compared with the fleet file; what is as the pins say is recorded as spark-pipelines' own "
                    "(markers, the container's launch spec, the JIT cache slots, the gateway's hand entries), "
                    "nothing that serves is changed; what differs is listed field by field and left as it is.",
    )
    @retry_unreachable(fleet.ssh)
    def fleet_adoption(context: dg.AssetExecutionContext, config: AdoptConfig, ssh: FleetSSH, hub: ModelHub,
                       litellm: LiteLLMGateway) -> dg.MaterializeResult:
        s = step_session(context, ssh, litellm)
        started = time.monotonic()
        findings = adopt_fleet(s, cv, check=config.check, nodes=config.nodes or None, hub=hub,
                               gw=litellm.host(), run_id=context.run.run_id, log=context.log)
        recorded = [] if config.check else [f"{f.step}[{f.node}]" for f in findings if record(context, cv, launch, f)]
        gw_found = next((f for f in findings if f.step == steps.GATEWAY), None)
        if not config.check and gw_found is not None and gw_found.action in (core.ADOPT, core.CURRENT):
            # As the gateway step records the config it leaves (its data version is the config's digest).
            records.record_step(context, steps.GATEWAY, None, cv[steps.GATEWAY],
                                markers.signature(litellm.host().read().config), {"adopted": True, "found": gw_found.why},
                                description=f"adopted from the live fleet: {gw_found.why}",
                                inputs={steps.NODE_DEPLOYMENT: None})  # as Dagster records a dep on every node
            recorded.append(steps.GATEWAY)
        meta: dict[str, Any] = {
            "check": config.check,
            "summary": ", ".join(f"{a}: {n}" for a, n in core.summary(findings).items()),
            "findings": table(COLUMNS, rows(findings)),
            "recorded": ", ".join(recorded) or "nothing",
            "seconds": round(time.monotonic() - started, 1),
            **hash_figures(findings),
            "changes_nothing_that_serves": all(f.changes_nothing for f in findings),
        }
        return dg.MaterializeResult(metadata=meta)

    adopt_job = dg.define_asset_job(
        steps.ADOPT_JOB, selection=dg.AssetSelection.assets(steps.FLEET_ADOPTION), tags=max_runtime(fleet, steps.ADOPT_JOB),
        description="First contact with a fleet built by hand: adopt what serves as the pins say, change nothing "
                    "(config check: true only says what the chain would do). Then run the chain: every step skips.")
    return dg.Definitions(assets=[fleet_adoption], jobs=[adopt_job])
