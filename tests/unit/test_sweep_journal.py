"""The sweep's reading of a deploy journal and of the node's run lease (runbook.sweep), from the
gather script's real output: the script runs here under sh against real files and a real flock."""

import json
import os
import subprocess

from spark_pipelines.runbook import sweep
from spark_pipelines.state.markers import DeployJournal

JOURNAL = DeployJournal(run_id="abcdef0123456789", token="t", owner="pid 1 on h", started="2026-01-01T00:00:00Z",
                        phase="launching").model_dump_json()


def gather(tmp_path, journal: str | None, lock: str | None, clean_boot: str | None = None):
    """Run GATHER_SCRIPT with stand-ins for nvidia-smi and docker; returns the journal/lease sections."""
    j = tmp_path / "deploy_journal.json"
    if journal is not None:
        j.write_text(journal)
    cb = tmp_path / "clean_boot.json"
    if clean_boot is not None:
        cb.write_text(clean_boot)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text("#!/bin/sh\necho 'No such container' >&2; exit 1\n")
    (bin_dir / "docker").chmod(0o755)
    argv = ["sh", "-c", sweep.GATHER_SCRIPT, "sh", "N0NCE", "5", "5", "5", "c", "10", str(j),
            lock or str(tmp_path / "no.lock"), str(cb), "true"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}).stdout
    return sweep.sections(out, "N0NCE")


def test_no_journal_no_section_and_the_lease_is_read_always(tmp_path):
    got = gather(tmp_path, None, None)
    assert "journal" not in got and "inspect" in got
    assert sweep.lease_held(got["lease"][0]) is False  # the ledger's journals need it too


def test_a_journal_with_the_lease_free_is_a_dead_deploy(tmp_path):
    got = gather(tmp_path, JOURNAL, None)  # never leased: no lock file
    d = sweep.deploy_in_flight(got["journal"][0], got["lease"][0])
    assert d is not None and d.dead and d.run_id == "abcdef0123456789" and d.phase == "launching"
    lock = tmp_path / "run.lock"
    lock.write_text("")  # a lease that ended: the file stays, nobody holds it
    got = gather(tmp_path, JOURNAL, str(lock))
    assert sweep.deploy_in_flight(got["journal"][0], got["lease"][0]).dead


def test_a_journal_whose_lease_is_held_is_a_deploy_in_progress(tmp_path):
    lock = tmp_path / "run.lock"
    holder = subprocess.Popen(["flock", "-n", str(lock), "sh", "-c", "echo held; exec cat"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        other = tmp_path / "other.lock"  # a lock on another file says nothing about this one
        other.write_text("")
        got = gather(tmp_path, JOURNAL, str(lock))
        d = sweep.deploy_in_flight(got["journal"][0], got["lease"][0])
        assert d is not None and d.lease_held is True and not d.dead
    finally:
        holder.stdin.close()
        holder.wait(10)
    got = gather(tmp_path, JOURNAL, str(lock))
    assert sweep.deploy_in_flight(got["journal"][0], got["lease"][0]).dead


def test_an_unreadable_lease_decides_nothing_and_a_torn_journal_is_none():
    assert sweep.deploy_in_flight(JOURNAL, "stat: cannot stat").lease_held is None
    assert sweep.deploy_in_flight(json.dumps({"phase": "x"}), "absent") is None


def test_the_nodes_measured_clean_boot_is_read_when_node_os_wrote_it(tmp_path):
    from spark_pipelines.state.markers import CleanBoot

    assert "cleanboot" not in gather(tmp_path, None, None)
    got = gather(tmp_path, None, None, CleanBoot(free_gib=116.8, measured_at="2026-12-05T00:00:00Z").model_dump_json())
    assert CleanBoot.model_validate_json(got["cleanboot"][0]).free_gib == 116.8
