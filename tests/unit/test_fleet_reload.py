"""The loaded fleet and a run's fleet cannot differ: the code location keeps the text it loaded
(reconstruction metadata), run workers rebuild from it, and the `ssh` resource refuses a run
whose file changed since, with one line, before anything is touched."""

from __future__ import annotations

import warnings

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.definitions_load_context import DefinitionsLoadContext, DefinitionsLoadType
from dagster._core.definitions.metadata.metadata_value import CodeLocationReconstructionMetadataValue
from dagster._core.definitions.repository_definition import RepositoryLoadData

from spark_pipelines import definitions
from spark_pipelines.core.fleet import fleet_digest

LINE = "the fleet file changed since the code location loaded: reload the code location (UI Reload) and launch again"


@pytest.fixture()
def fleet_file(tmp_path, seed_data, monkeypatch):
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    monkeypatch.setenv(definitions.FLEET_ENV, str(p))
    monkeypatch.setenv("SPARK_COMMAND_LOG", str(tmp_path / "commands.jsonl"))
    return p


def edit(p, change):
    data = yaml.safe_load(p.read_text())
    change(data)
    p.write_text(yaml.safe_dump(data, sort_keys=False))


def test_a_run_after_a_valid_edit_is_refused_with_one_line_and_touches_nothing(fleet_file, tmp_path):
    defs = definitions.build_definitions(str(fleet_file))
    assert defs.resources["ssh"].fleet_digest == fleet_digest(fleet_file.read_text())
    edit(fleet_file, lambda d: d["nodes"][1].update(host="spark2-new"))
    res = defs.resolve_job_def("release_quarantine_job").execute_in_process(
        instance=dg.DagsterInstance.ephemeral(), partition_key="spark1", raise_on_error=False)
    assert not res.success
    errors = []  # in process the resources are set up once for the run: a run failure
    for e in res.all_events:
        err = (e.step_failure_data.error if e.is_step_failure else
               e.event_specific_data.error if e.is_run_failure else None)
        while err is not None and err.cause is not None:
            err = err.cause
        if err is not None:
            errors.append(err)
    assert errors and all(err.cls_name == "FleetChanged" for err in errors)
    assert LINE in errors[0].message and "nothing was touched" in errors[0].message
    assert not (tmp_path / "commands.jsonl").exists()  # not one remote command


def test_the_same_file_runs(fleet_file):
    """No edit: the resource's session is the loaded fleet (a sensor's setup never refuses)."""
    defs = definitions.build_definitions(str(fleet_file))
    with dg.build_resources({"ssh": defs.resources["ssh"]}) as r:
        assert r.ssh.fleet.node("spark2").host == "spark2"


def test_a_run_worker_rebuilds_from_the_loaded_text_not_the_file(fleet_file):
    init = DefinitionsLoadContext(DefinitionsLoadType.INITIALIZATION)
    with DefinitionsLoadContext.scoped(init):
        definitions.defs()  # the code server's load: the text kept for run workers
    text = fleet_file.read_text()
    assert init.get_pending_reconstruction_metadata()[definitions.FLEET_TEXT_KEY] == text
    edit(fleet_file, lambda d: d["nodes"].append({**d["nodes"][1], "name": "spark3", "host": "spark3"}))
    ctx = DefinitionsLoadContext(DefinitionsLoadType.RECONSTRUCTION, RepositoryLoadData(
        cacheable_asset_data={}, reconstruction_metadata={
            definitions.FLEET_TEXT_KEY: CodeLocationReconstructionMetadataValue(text)}))
    with warnings.catch_warnings(), DefinitionsLoadContext.scoped(ctx):
        warnings.simplefilter("ignore")
        worker = definitions.defs()
    # The worker's partitions are the loaded ones; its resource refuses the file as it is now.
    parts = worker.resolve_job_def("deploy_node_job").partitions_def.get_partition_keys()
    assert parts == ["spark1", "spark2"]
    assert worker.resources["ssh"].fleet_digest == fleet_digest(text) != fleet_digest(fleet_file.read_text())
