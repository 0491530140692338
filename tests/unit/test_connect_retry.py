"""A step that could not open its SSH session is retried by Dagster with backoff; a host-key
mismatch and a step with retries off fail at once (fleet file: ssh.connect_retries / _backoff_s).
Whatever a node or a procedure raised fails the step as one line, never a traceback."""

import dagster as dg
import pytest

from spark_pipelines.assets import one_line_failures, retry_unreachable
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import FleetError, parse_fleet
from spark_pipelines.core.fleet_settings import StepRetrySettings
from spark_pipelines.resources.ssh.errors import HostKeyError, NodeConnectError, NodeUnresponsive, RemoteCommandError


def attempts_of(settings: StepRetrySettings, failures: list[Exception], generator: bool = False):
    """Materialize one asset whose body raises failures[0], failures[1], ... then succeeds."""
    calls: list[int] = []

    def attempt(context: dg.AssetExecutionContext) -> int:
        calls.append(context.retry_number)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return len(calls)

    def as_generator(context: dg.AssetExecutionContext):
        yield dg.Output(attempt(context))

    def as_function(context: dg.AssetExecutionContext):
        return attempt(context)

    flaky = dg.asset(name="flaky")(retry_unreachable(settings)(as_generator if generator else as_function))
    result = dg.materialize([flaky], raise_on_error=False)
    retries = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    if not result.success:
        failed = [e.step_failure_data for e in result.all_events if e.is_step_failure]
        last = failures[len(calls) - 1]
        # The step fails as the error's one line (a RunbookError: its description), not a traceback.
        said = last.description if isinstance(last, RunbookError) else first_line(last)
        assert [(f.error.cls_name, f.user_failure_data.description) for f in failed] == [("Failure", said)], failed
    return result.success, calls, [e.event_specific_data.seconds_to_wait for e in retries]


@pytest.mark.parametrize("generator", [False, True])
def test_connect_failures_are_retried_with_doubling_backoff(generator):
    ok, calls, waits = attempts_of(StepRetrySettings(connect_retries=2, connect_backoff_s=1),
                                   [NodeConnectError("spark2: connection refused")] * 2, generator)
    assert ok and calls == [0, 1, 2] and waits == [1, 2]


def test_retries_end_with_the_connect_error():
    ok, calls, waits = attempts_of(StepRetrySettings(connect_retries=1, connect_backoff_s=1),
                                   [NodeConnectError("spark2: connection refused")] * 3)
    assert not ok and calls == [0, 1] and waits == [1]


@pytest.mark.parametrize("error", [HostKeyError("spark2: host key mismatch"),
                                   RemoteCommandError("spark2", "docker run ...", 1, "launch failed")])
def test_host_key_mismatch_and_failures_after_connecting_are_never_retried(error):
    ok, calls, waits = attempts_of(StepRetrySettings(connect_retries=3, connect_backoff_s=1), [error])
    assert not ok and calls == [0] and waits == []


def test_retries_off_fails_at_once():
    ok, calls, waits = attempts_of(StepRetrySettings(connect_retries=0), [NodeConnectError("spark2: no route")])
    assert not ok and calls == [0] and waits == []


def test_fleet_file_ssh_settings(seed_data):
    assert parse_fleet(seed_data, "f.yaml").ssh == StepRetrySettings(connect_retries=2, connect_backoff_s=20)
    seed_data["ssh"] = {"connect_retries": -1}
    with pytest.raises(FleetError, match="ssh.connect_retries"):
        parse_fleet(seed_data, "f.yaml")



def test_a_node_that_froze_after_connecting_fails_the_step_as_one_line_with_the_whole_text_kept():
    frozen = NodeUnresponsive("spark2", 30, "docker inspect")
    ok, calls, _ = attempts_of(StepRetrySettings(connect_retries=3, connect_backoff_s=1), [frozen])
    assert not ok and calls == [0]  # never retried: the session had opened


@pytest.mark.parametrize("error", [NodeUnresponsive("spark2", 30, "cp -a jit cache"),
                                   RunbookError("spark2: the cache does not fit; free 3 GiB", {"df": "`97%`"})])
def test_an_op_fails_as_one_line_with_its_details(error):
    @dg.op
    @one_line_failures
    def step(context: dg.OpExecutionContext) -> None:
        raise error

    @dg.job
    def job():
        step()

    result = job.execute_in_process(raise_on_error=False)
    (failure,) = [e.step_failure_data for e in result.all_events if e.is_step_failure]
    assert failure.error.cls_name == "Failure" and failure.error.cause is None  # no stack below it
    meta = failure.user_failure_data.metadata
    if isinstance(error, RunbookError):
        assert failure.user_failure_data.description == error.description and meta["df"].value == "`97%`"
    else:
        assert failure.user_failure_data.description == first_line(error)
        assert "cp -a jit cache" in meta["error"].value
