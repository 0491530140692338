"""Where a step's output waits for the next step: Dagster's filesystem I/O manager, saying what to
run when an input was never stored here.

A step recorded without an output (adopted from a fleet built by hand, or materialized on another
instance) has a materialization but no stored value; loading it as the next step's input would
fail with Dagster's raw "DagsterExecutionLoadInputError". The step that stores it is named instead:
on a fleet whose markers match, that job skips every heavy step in seconds.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster._core.storage.fs_io_manager import PickledObjectFilesystemIOManager

# The job whose run stores each step's output.
STORED_BY = {
    "base_model": "build_job", "hybrid_checkpoint": "build_job", "mtp_weights": "build_job",
    "base_image": "build_job", "serving_image": "build_job",
    "node_artifacts": "deploy_node_job", "node_deployment": "deploy_node_job",
}


class _Outputs(PickledObjectFilesystemIOManager):
    def load_input(self, context: dg.InputContext) -> Any:
        try:
            return super().load_input(context)
        except FileNotFoundError:
            step = context.asset_key.to_user_string() if context.has_asset_key else context.name
            job = STORED_BY.get(step, f"the job that materializes {step}")
            where = f" for {context.asset_partition_key}" if context.has_asset_partitions else ""
            raise dg.Failure(description=(
                f"{step}{where} has no stored output on this Dagster instance (it was adopted from a hand-built "
                f"fleet or materialized elsewhere): run {job}{where} first; where the fleet's markers match it "
                f"skips every heavy step in seconds, then run this job again")) from None


class StepOutputs(dg.FilesystemIOManager):
    """The default I/O manager of every step (under the instance's storage directory)."""

    def create_io_manager(self, context: dg.InitResourceContext) -> PickledObjectFilesystemIOManager:
        base_dir = self.base_dir or context.instance.storage_directory()  # type: ignore[union-attr]
        return _Outputs(base_dir=base_dir)
