"""The steps' I/O manager: an input never stored on this instance names the job that stores it."""

import dagster as dg


def test_an_input_never_stored_here_names_the_job_that_stores_it(tmp_path):
    """An adopted step has a materialization but no stored output: the next step says what to run
    instead of Dagster's raw DagsterExecutionLoadInputError."""
    from spark_pipelines.resources.step_outputs import StepOutputs

    @dg.asset(name="mtp_weights")
    def upstream() -> int:
        return 1

    @dg.asset
    def node_artifacts(mtp_weights: int) -> int:
        return mtp_weights + 1

    defs = dg.Definitions(assets=[upstream, node_artifacts],
                          jobs=[dg.define_asset_job("deploy", selection=["node_artifacts"])],
                          resources={"io_manager": StepOutputs(base_dir=str(tmp_path))})
    res = defs.resolve_job_def("deploy").execute_in_process(raise_on_error=False)
    failure = next(e.step_failure_data for e in res.all_events if e.is_step_failure)
    assert failure.user_failure_data is not None
    assert failure.user_failure_data.description.startswith(
        "mtp_weights has no stored output on this Dagster instance") and "run build_job first" in failure.user_failure_data.description
    # Once stored, the same job loads it.
    assert dg.materialize([upstream], resources={"io_manager": StepOutputs(base_dir=str(tmp_path))}).success
    assert defs.resolve_job_def("deploy").execute_in_process().success
