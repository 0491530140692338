"""Checkpoint versions no node needs any more, removed (`checkpoint_gc_job`).

Short wiring around runbook/versions.py `collect`: each node under its lease, one at a time. The
launchpad's default is the check: it lists per node what it would keep and why, what it would
remove and the space that frees, and removes nothing; `check: false` is the run that removes.
Never removed: the version a node serves, one a rollout point or a deploy journal names, the
node's last known good, and the `versions.keep` newest (fleet file).
"""

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import fail, one_line_failures
from spark_pipelines.core import steps
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import versions


class CheckpointGcConfig(dg.Config):
    check: bool = Field(default=True, description="Only say what would be removed (the default); false removes it.")
    nodes: list[str] = Field(default_factory=list, description="Node names; empty: every node of the fleet.")


def versions_definitions(fleet: Fleet) -> dg.Definitions:
    @dg.op(description="Per node under its lease: the checkpoint versions kept (and why) and those removed.")
    @one_line_failures
    def collect_checkpoint_versions(context: dg.OpExecutionContext, config: CheckpointGcConfig,
                                    ssh: FleetSSH) -> dg.Output[dict]:
        s = ssh.session
        f = s.fleet
        try:
            targets = [f.node(n) for n in config.nodes] if config.nodes else list(f.nodes)
        except Exception as e:  # an unknown name: FleetError naming the known ones
            fail(RunbookError(str(e)))
        lines: list[str] = []
        freed = 0
        for node in targets:
            with node_lease(s, node.name, "checkpoint gc", run_id=context.run.run_id):
                report = versions.collect(s, node, keep=f.versions.keep, check=config.check)
            for line in report.lines():
                context.log.info(line)
            lines += report.lines()
            freed += report.plan.freed_kib
        verb = "would free" if config.check else "freed"
        summary = f"{verb} {freed / 2**20:.1f} GiB" + (" (check: nothing removed)" if config.check else "")
        context.log.info(summary)
        return dg.Output({"lines": lines, "freed_kib": freed}, metadata={
            "check": config.check, "summary": summary,
            "versions": dg.MetadataValue.md("\n".join(f"- {ln}" for ln in lines) or "no checkpoint version on any node"),
        })

    @dg.job(name=steps.CHECKPOINT_GC_JOB, tags={"spark/kind": "maintenance"},
            description="Checkpoint versions no node serves, no rollout point or deploy journal names and that are "
                        "not a node's last known good, beyond the versions.keep newest: listed (check, the default) "
                        "or removed (check: false). Each node under its lease.")
    def checkpoint_gc_job():
        collect_checkpoint_versions()

    return dg.Definitions(jobs=[checkpoint_gc_job])



