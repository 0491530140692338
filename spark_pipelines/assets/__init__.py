"""One module per runbook phase; each returns the dg.Definitions of its assets, checks and jobs.

This module and metadata.py / bench_metadata.py are the asset floor's shared wiring (a step's
session and failure, retries, the per-node partitions and checks, the gateway's rotation as an
observation, how figures reach the UI). The phase modules import only these of each other
(pyproject's independence contract): a procedure lives in runbook/, not in a sibling asset."""

from __future__ import annotations

import functools
import warnings
import inspect
from collections.abc import Callable
from typing import Any, NoReturn

import dagster as dg

from spark_pipelines.assets.metadata import table
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.fleet_settings import StepRetrySettings
from spark_pipelines.resources.ssh.errors import HostKeyError, NodeConnectError, RemoteError
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.state import records


def fail(e: RunbookError) -> NoReturn:
    """A runbook procedure's domain error as the step failure the UI shows (details as markdown)."""
    raise dg.Failure(description=e.description,
                     metadata={k: dg.MetadataValue.md(v) for k, v in e.details.items()}) from None


def step_session(context: dg.AssetExecutionContext, *resources: object):
    """The resources' SSH session, its log lines attached to this step: the resource was opened
    with the run's log (no step), so every ssh/docker line would otherwise float above the steps.
    Pass each resource holding a FleetSSH (ssh, litellm); returns the first one's session. The
    session can ask the instance whether another run ended (a journal's, runbook/journal.py), and
    a run killed earlier whose process is gone is marked failed first (state/records.py)."""
    instance = context.instance
    for run_id in records.fail_dead_runs(instance, besides=context.run.run_id):
        context.log.warning(f"run {run_id} was STARTED but its process is gone (killed): marked failed")
    sessions = []
    for r in resources:
        ssh = getattr(r, "ssh", r)
        s = ssh.session  # type: ignore[attr-defined]
        s.log = context.log
        s.run_ended = lambda run_id: records.run_ended(instance, run_id)
        sessions.append(s)
    return sessions[0]


def remote_failure(e: RemoteError) -> NoReturn:
    """A node's or a tool's failure that no procedure turned into a RunbookError (a frozen dockerd,
    a copy cut off, a command that failed) as the step's failure: its one line (it names the node)
    with the whole text as metadata, not a traceback in the UI (the 60-minute soak showed one)."""
    raise dg.Failure(description=first_line(e),
                     metadata={"error": dg.MetadataValue.md(f"```\n{str(e)[:4000]}\n```")}) from None


def _wrapped(fn: Callable[..., Any], on_error: Callable[[Any, Exception], NoReturn]) -> Callable[..., Any]:
    """fn (a plain or a generator step) with its RemoteError and RunbookError handed to on_error."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(context, *args, **kwargs):
            try:
                yield from fn(context, *args, **kwargs)
            except (RemoteError, RunbookError) as e:
                on_error(context, e)
        return steps

    @functools.wraps(fn)
    def step(context, *args, **kwargs):
        try:
            return fn(context, *args, **kwargs)
        except (RemoteError, RunbookError) as e:
            on_error(context, e)
    return step


def as_step_failure(e: Exception) -> NoReturn:
    """A domain error as its description (`fail`), any other remote error as its one line
    (`remote_failure`): never a traceback."""
    if isinstance(e, RunbookError):
        fail(e)
    remote_failure(e)  # type: ignore[arg-type]


def one_line_failures(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Under @dg.op / @dg.asset: whatever the node or a procedure raised fails the step as one
    line (`as_step_failure`)."""
    return _wrapped(fn, lambda context, e: as_step_failure(e))


def retry_unreachable(settings: StepRetrySettings) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Under @dg.asset: a step whose SSH session could not be opened is retried by Dagster after
    connect_backoff_s, doubled each time, up to connect_retries times. Only that failure: a host
    key mismatch, or anything after the session opened, fails the step at once, as one line
    (`as_step_failure`; a node powered off mid-rollout once failed a step with a traceback)."""

    def retry_or_fail(context: dg.AssetExecutionContext, e: Exception) -> NoReturn:
        if (not isinstance(e, NodeConnectError) or isinstance(e, HostKeyError)
                or context.retry_number >= settings.connect_retries):
            as_step_failure(e)
        wait = settings.connect_backoff_s * 2 ** context.retry_number
        context.log.warning(f"{e} -- retry {context.retry_number + 1} of {settings.connect_retries} in {wait} s")
        raise dg.RetryRequested(max_retries=settings.connect_retries, seconds_to_wait=wait) from e

    return lambda fn: _wrapped(fn, retry_or_fail)


def node_partitions(fleet: Fleet) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([n.name for n in fleet.serve_nodes])


def node_check(name: str, asset: str, partitions: dg.PartitionsDefinition, description: str,
               blocking: bool = True) -> dg.AssetCheckSpec:
    """A check evaluated per node: its results carry the partition, so the UI's check history
    names the node. Partitioned checks are a 1.13 preview; the warning is said once, here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, blocking=blocking, partitions_def=partitions,
                                 description=description)



LEFT_OUT_COLUMNS = (("node", "string", "serve node out of the rotation"),
                    ("why", "string", "why it is out, in the words of whoever put it out"))


def left_out_table(left_out: dict[str, str]) -> dg.MetadataValue:
    """Who is out and why, as a table a person reads (records.latest_rotation reads it back)."""
    return table(LEFT_OUT_COLUMNS, [{"node": n, "why": why} for n, why in left_out.items()])


def record_rotation(context: dg.AssetExecutionContext | dg.OpExecutionContext, gw: object, event: str,
                    left_out: dict[str, str]) -> None:
    """An observation on `gateway`: its rotation after a drain or restore by a bench, a quarantine,
    a release or a reconcile (the gateway's own materialization shows the rotation it wrote, not
    what happened since; the fleet summary reads the newest of both). Never fails the caller."""
    try:
        rotation = gw.rotation()  # type: ignore[attr-defined]
    except Exception as e:  # a record must never fail the step it records
        context.log.warning(f"gateway rotation not read after '{event}': {first_line(e)}")
        return
    records.observe(context, steps.GATEWAY, None, description=f"{event}: rotation now {', '.join(rotation) or 'empty'}",
                    metadata={"event": event, keys.ROTATION: ", ".join(rotation), "nodes_in_rotation": len(rotation),
                              keys.LEFT_OUT_BY_NODE: left_out_table(left_out)})


def record_bench_rotation(context: dg.AssetExecutionContext, gw: object, benched: Any) -> None:
    """What a bench (runbook.bench.Benched) did to the gateway, each change as `record_rotation`."""
    for event, left_out in benched.rotation:
        record_rotation(context, gw, event, left_out)
