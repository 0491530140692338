"""Pure pieces of remote execution: quoting, sudo detection, rsync/ssh argv, verification, tail."""

import json
import shlex
import struct

import pytest

from spark_pipelines.core import remote

ROUTE = remote.PeerRoute("operator", "10.0.0.2", 2222, "/home/op/.ssh/peer", "/home/op/.ssh/peer_known_hosts")


def test_quote_argv_round_trips_through_a_shell_parser():
    argv = ["printf", "%s\n", "a b", "$HOME", "it's", "; rm -rf /", "`id`", '{"method":"mtp"}']
    line = remote.quote_argv(argv)
    assert shlex.split(line) == argv
    assert "'; rm -rf /'" in line


@pytest.mark.parametrize("bad", ["docker ps", b"docker", [], ["docker", 3], ["a\x00b"]])
def test_check_argv_refuses_strings_and_junk(bad):
    with pytest.raises(remote.ArgvError):
        remote.check_argv(bad)


def test_check_argv_message_says_how_to_fix_a_shell_string():
    with pytest.raises(remote.ArgvError, match=r"split it"):
        remote.check_argv("docker ps -a")


def test_with_env_and_timeout_wrap_argv():
    assert remote.with_env(["vllm"], {"MAX_JOBS": "2"}) == ["env", "MAX_JOBS=2", "vllm"]
    assert remote.with_env(["vllm"], {}) == ["vllm"]
    with pytest.raises(ValueError, match="environment variable name"):
        remote.with_env(["x"], {"bad name": "1"})
    assert remote.with_timeout(["sleep", "9"], 2.4) == ["timeout", "-k", "10", "2", "sleep", "9"]


def test_secret_env_file_quotes_values_and_refuses_newlines():
    text = remote.secret_env_file({"HF_TOKEN": "hf_a'b c"})
    assert shlex.split(text.split("=", 1)[1]) == ["hf_a'b c"]
    with pytest.raises(ValueError, match="HF_TOKEN"):
        remote.secret_env_file({"HF_TOKEN": "a\nb"})
    argv = remote.source_env_file_argv("/home/u/.cache/env-1", ["huggingface-cli", "download"])
    assert argv[:2] == ["sh", "-c"] and argv[3] == "/home/u/.cache/env-1" and argv[4:] == ["huggingface-cli", "download"]
    assert "hf_" not in " ".join(argv)


def test_redact_hides_secret_values():
    assert remote.redact("token=hf_secret123 ok", ["hf_secret123"]) == "token=*** ok"
    assert remote.redact("abc", [""]) == "abc"


def test_sudo_password_detection_and_advice():
    assert remote.sudo_argv(["apt-get", "update"]) == ["sudo", "-n", "apt-get", "update"]
    assert remote.sudo_wants_password("sudo: a password is required\n")
    assert remote.sudo_wants_password("sudo: a terminal is required to read the password")
    assert not remote.sudo_wants_password("E: Could not open lock file")
    advice = remote.sudo_advice("spark2", "operator", "/usr/bin/apt-get")
    assert "spark2" in advice and "operator ALL=(root) NOPASSWD: /usr/bin/apt-get" in advice
    with pytest.raises(ValueError, match="absolute"):
        remote.sudoers_line("operator", "apt-get")


def test_output_tail_keeps_the_end_and_counts_what_it_dropped():
    t = remote.OutputTail(max_lines=3, max_line_chars=10)
    for i in range(10):
        t.add(f"line {i}")
    t.add("x" * 25)
    assert t.lines == ["line 8", "line 9", "x" * 10 + " ...[15 more chars]"]
    assert t.total_lines == 11 and t.dropped == 8
    assert t.text().startswith("[... 8 earlier lines]")


def test_line_splitter_yields_lines_as_they_complete():
    s = remote.LineSplitter()
    assert s.feed(b"one\ntw") == ["one"]
    assert s.feed(b"o\r\nprogress 10%\rprogress 20%\r") == ["two", "progress 10%", "progress 20%"]
    assert s.feed(b"\xff tail") == []
    assert s.flush() == ["\ufffd tail"]
    assert s.flush() == []


def test_peer_route_ssh_argv_pins_the_known_hosts_file():
    argv = ROUTE.ssh_argv()
    assert "StrictHostKeyChecking=yes" in argv and "BatchMode=yes" in argv
    assert f"UserKnownHostsFile={ROUTE.known_hosts}" in argv
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == ROUTE.key_path
    remote_cmd = ROUTE.remote_argv(["docker", "load"])
    assert remote_cmd[-2:] == ["operator@10.0.0.2", "docker load"]


def test_rsync_argv_is_resumable_and_pushes_contents():
    argv = remote.rsync_argv("/home/op/models/m", ROUTE, "/home/op2/models/m/", bwlimit_kib=500)
    assert argv[0] == "rsync" and "-a" in argv
    assert "--partial-dir=.rsync-partial" in argv and "--inplace" not in argv and "--whole-file" not in argv
    assert "--bwlimit=500" in argv
    assert argv[-2:] == ["/home/op/models/m/", "operator@10.0.0.2:/home/op2/models/m/"]
    e = argv[argv.index("-e") + 1]
    assert shlex.split(e) == ROUTE.ssh_argv()


@pytest.mark.parametrize("bad", ["~/models", "models/m", "/tmp/a b", "/tmp/$(id)"])
def test_rsync_argv_refuses_relative_or_shell_paths(bad):
    with pytest.raises(ValueError):
        remote.rsync_argv(bad, ROUTE, "/dst")


def test_parse_rsync_stats_reads_bytes_sent():
    text = """Number of regular files transferred: 3
Total file size: 524,576 bytes
Literal data: 1,024 bytes
Matched data: 523,552 bytes
Total bytes sent: 25,015
Total bytes received: 80
"""
    stats = remote.parse_rsync_stats(text)
    assert stats["total_bytes_sent"] == 25015
    assert stats["matched_data"] == 523552
    assert stats["number_of_regular_files_transferred"] == 3


def test_image_stream_argv_is_one_pipefail_pipeline():
    argv = remote.image_stream_argv("vllm-qwen35-v2", ROUTE)
    assert argv[:4] == ["bash", "-o", "pipefail", "-c"]
    left, right = argv[4].split(" | ")
    assert shlex.split(left) == ["docker", "save", "vllm-qwen35-v2"]
    assert shlex.split(right)[-1] == "docker load"
    with pytest.raises(ValueError):
        remote.image_stream_argv("bad image;rm", ROUTE)


def test_file_listing_round_trip_and_tree_comparison():
    argv = remote.list_files_argv("/m")
    assert "-prune" in argv and "*/.rsync-partial" in argv
    sizes = remote.parse_file_sizes("a.safetensors\t10\nsub/b.json\t3\n")
    assert sizes == {"a.safetensors": 10, "sub/b.json": 3}
    with pytest.raises(ValueError):
        remote.parse_file_sizes("no-tab-here\n")
    problems = remote.compare_trees({"a": 10, "b": 3, "c": 1}, {"a": 9, "b": 3, "z": 1})
    assert problems == [
        "a: 9 bytes on the destination, 10 on the source",
        "c: missing on the destination",
        "1 file(s) on the destination that the source does not have, e.g. z",
    ]
    assert remote.compare_trees({"a": 1}, {"a": 1}) == []


def test_check_index_names_missing_shards():
    index = json.dumps({"weight_map": {"w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors"}})
    keys, problems = remote.check_index(index, {"model-00001-of-00002.safetensors": 100}, "idx.json")
    assert keys == 2
    assert problems == ["idx.json names model-00002-of-00002.safetensors, which is not on the destination"]
    assert remote.check_index("{", {}, "idx.json")[1][0].startswith("idx.json: unreadable")


def test_header_span_matches_a_real_safetensors_file(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    p = tmp_path / "s.safetensors"
    save_file({"a": np.zeros((3, 5), np.float32), "b": np.ones(7, np.uint8)}, str(p))
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert remote.header_span(n, raw[8 : 8 + n]) == len(raw)


def test_known_hosts_and_authorized_keys_lines():
    assert remote.known_hosts_name("h", 22) == "h"
    assert remote.known_hosts_line("127.0.0.1", 2201, "ssh-ed25519", "AAAAC3Nz") == "[127.0.0.1]:2201 ssh-ed25519 AAAAC3Nz"
    line = remote.authorized_keys_line("ssh-ed25519 AAAAC3Nzkey old-comment", "spark-pipelines-peer@spark1")
    assert line == "restrict ssh-ed25519 AAAAC3Nzkey spark-pipelines-peer@spark1"
    with pytest.raises(ValueError):
        remote.authorized_keys_line("command=\"x\" ssh-ed25519 AAA", "c")
    # A fan-out holder's key is valid only from the holder's address; a name cannot smuggle options.
    line = remote.authorized_keys_line("ssh-ed25519 AAAAC3Nzkey c", "peer@spark3", "10.213.0.13")
    assert line == 'restrict,from="10.213.0.13" ssh-ed25519 AAAAC3Nzkey peer@spark3'
    with pytest.raises(ValueError):
        remote.authorized_keys_line("ssh-ed25519 AAAAC3Nzkey c", "peer@spark3", '10.0.0.1",command="sh')


def test_rollback_names():
    assert remote.previous_container_name("vllm-qwen35-v2") == "vllm-qwen35-v2-previous"
    assert remote.previous_image_tag("vllm-qwen35-v2") == "vllm-qwen35-v2:previous"
    assert remote.previous_image_tag("vllm-qwen35-v2:abc123") == "vllm-qwen35-v2:previous"
    assert remote.previous_image_tag("team/vllm:v2") == "team/vllm:previous"


# -- log batching -----------------------------------------------------------------------------------


def _feed(b: remote.LogBatcher, lines: list[str], start: float = 0.0, step: float = 0.0) -> list[str]:
    events: list[str] = []
    for i, line in enumerate(lines):
        events += b.add(line, start + i * step)
    return events


def test_log_batcher_sends_a_lone_line_at_once_and_joins_a_burst():
    b = remote.LogBatcher(max_lines=5, max_seconds=2.0, max_events=10)
    assert b.add("first", 0.0) == ["first"]  # nothing pending, nothing sent lately: live
    assert b.add("a", 0.1) == [] and b.add("b", 0.2) == [] and b.add("c", 0.3) == []
    assert b.tick(1.0) == []  # the batch is 0.9 s old
    assert b.tick(2.2) == ["a\nb\nc"]  # 2.1 s old: out, without waiting for another line
    assert b.add("d", 2.3) == []  # sent 0.1 s ago: batched again
    assert b.finish(3.0, "out.log") == ["d"]
    assert b.events == 3 and b.suppressed == 0


def test_log_batcher_flushes_at_max_lines():
    b = remote.LogBatcher(max_lines=3, max_seconds=60.0, max_events=10)
    events = _feed(b, [f"l{i}" for i in range(7)], step=0.01)
    assert events == ["l0", "l1\nl2\nl3", "l4\nl5\nl6"]
    assert b.finish(1.0, "x") == []


def test_log_batcher_after_quiet_spell_sends_the_next_line_at_once():
    b = remote.LogBatcher(max_lines=100, max_seconds=1.0, max_events=10)
    assert b.add("one", 0.0) == ["one"]
    assert b.add("two", 5.0) == ["two"]  # quiet for 5 s: no reason to hold it back
    assert b.add("three", 5.1) == []
    assert b.tick(6.2) == ["three"]


def test_log_batcher_bounds_the_events_and_names_the_file():
    b = remote.LogBatcher(max_lines=10, max_seconds=60.0, max_events=5, closing_lines=3)
    lines = [f"line-{i}" for i in range(40_000)]
    events = _feed(b, lines, step=0.0001) + b.finish(10.0, "/tmp/out.log")
    assert len(events) == 6  # five batches and the closing event
    shown = [x for e in events[:-1] for x in e.split("\n")]
    assert shown == lines[: len(shown)]
    held = 40_000 - len(shown)
    assert events[-1].startswith(f"... {held} more lines in /tmp/out.log")
    assert events[-1].endswith("line-39997\nline-39998\nline-39999")


def test_log_batcher_is_linear_in_the_lines():
    import time as _time

    b = remote.LogBatcher()
    t0 = _time.perf_counter()
    for i in range(200_000):
        b.add("x" * 80, i * 1e-5)
    b.finish(10.0, "f")
    assert _time.perf_counter() - t0 < 5  # ~0.2 s; a quadratic policy takes minutes


def test_log_batcher_refuses_nonsense_limits():
    with pytest.raises(ValueError):
        remote.LogBatcher(max_lines=0)
    with pytest.raises(ValueError):
        remote.LogBatcher(max_events=0)


def test_every_runbook_limit_is_positive_and_long_steps_outlast_the_default():
    d = remote.DEFAULT_COMMAND_TIMEOUT_S
    assert 0 < remote.PROBE_TIMEOUT_S < d
    assert remote.IMAGE_BUILD_TIMEOUT_S >= 90 * 60  # runbook: ~90 min on GX10
    assert remote.CHECKPOINT_BUILD_TIMEOUT_S >= 20 * 60  # runbook: ~20 min
    assert min(remote.DOWNLOAD_TIMEOUT_S, remote.COPY_TIMEOUT_S, remote.IMAGE_COPY_TIMEOUT_S) > d


def test_copy_failure_names_the_receiver_and_the_fix():
    from spark_pipelines.resources.transfer import copy_failure

    out = ("rsync: [receiver] write failed on \"/home/u/models/x/model-00001.safetensors\": "
           "No space left on device (28)\nrsync error: error in file IO (code 11)\n")
    msg = copy_failure("spark1", "spark2", "/home/u/models/x", 11, out)
    assert "spark2 ran out of disk space" in msg and "df -h /home/u/models/x" in msg and "resumes" in msg
    assert "\n" not in msg
    other = copy_failure("spark1", "spark2", "/d", 12, "rsync: connection unexpectedly closed\n")
    assert "status 12" in other and "connection unexpectedly closed" in other and "spark2" in other


def test_copy_failure_on_a_file_io_error_says_where_and_how_much_is_free():
    from spark_pipelines.resources.transfer import copy_failure

    msg = copy_failure("spark1", "spark2", "/m/x", 11, "model-00001.safetensors\n", free_mib=0)
    assert "spark2 could not write under /m/x" in msg and "0 MiB free there" in msg and "df -h /m/x" in msg


def test_rsync_leftovers_are_temp_copies_of_present_files_only():
    listing = {
        "model-00001-of-00002.safetensors": 10,
        ".model-00001-of-00002.safetensors.GS6pKr": 4,  # a killed receiver's temp copy
        "sub/config.json": 1,
        "sub/.config.json.a1B2c3": 1,
        ".orphan.bin.Zz9Yy8": 3,  # its file is not there (yet): not ours to remove
        ".hidden-but-legit": 2,
        ".model-00001-of-00002.safetensors.toolong7": 1,
    }
    assert remote.rsync_leftovers(listing) == [".model-00001-of-00002.safetensors.GS6pKr", "sub/.config.json.a1B2c3"]
    assert remote.rsync_leftovers({"a": 1}) == []
