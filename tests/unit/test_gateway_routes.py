"""Routes, not owners: a hand-written entry for a fleet node is a route like any other. Drains take
a node out of every route and restores put back exactly those bytes; take-over adopts the
runbook's hand entries in place; every rewrite keeps the operator's comments."""

from __future__ import annotations

import difflib

import pytest

from spark_pipelines.core import gateway
from spark_pipelines.core.fleet import parse_fleet
from tests.plugins.gateway_config import runbook_config

IP1, IP2 = "192.0.2.11", "192.0.2.12"
OTHER = """\
  # the operator's own backend, not a fleet node
  - model_name: embed
    litellm_params:
      model: openai/bge-m3
      api_base: http://192.0.2.99:8080/v1
      api_key: sk-operator-literal
litellm_settings:
  drop_params: true  # keep this comment
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
"""


@pytest.fixture()
def fleet(seed_data):
    seed_data["nodes"][0]["host"] = IP1
    seed_data["nodes"][1]["host"] = IP2
    seed_data["gateway"]["min_in_rotation"] = 0
    return parse_fleet(seed_data)


def text_of(indent: int = 2, tail: str = OTHER) -> str:
    return runbook_config(IP1, IP2, indent=indent, tail=tail if indent == 2 else "")


def pools(config, fleet):
    return {p: sorted(n) for p, n in gateway.routes(config, fleet).items()}


BOTH = {"fast": ["spark1", "spark2"], "reasoning": ["spark1", "spark2"], "code": ["spark1", "spark2"]}


def body(text: str) -> list[str]:
    """The file without spark-pipelines' drain-note header lines."""
    return [line for line in text.splitlines() if not line.startswith(gateway.DRAIN_NOTE)]


# -- routes ---------------------------------------------------------------------------------------


def test_endpoint_is_compared_normalised():
    e = gateway.endpoint
    base = e("http://10.0.0.1:8000/v1")
    for same in ("HTTP://10.0.0.1:8000/v1/", "http://10.0.0.1:8000", "http://10.0.0.1:8000/", " http://10.0.0.1:8000/v1 "):
        assert e(same) == base, same
    assert e("http://Spark1/v1") == e("http://spark1:80") == ("http", "spark1", 80, "")
    assert e("https://spark1/v1") == ("https", "spark1", 443, "")
    assert e("http://[FD00::2]:8000/v1") == ("http", "fd00::2", 8000, "")
    assert e("http://10.0.0.1:8001/v1") != base and e("http://10.0.0.1:8000/api/v1") != base
    for none in ("os.environ/SPARK1_URL", "", None, 42, "10.0.0.1:8000", "ftp://x/v1", "http://:8000/v1"):
        assert e(none) is None, none


def test_a_hand_entry_routes_to_the_node_its_api_base_names(fleet):
    cfg = gateway.load(text_of())
    assert [gateway.route(x, fleet) for x in cfg["model_list"]] == ["spark1"] * 3 + ["spark2"] * 3 + [None]
    assert all(gateway.owner(x) is None for x in cfg["model_list"])
    assert gateway.nodes_in_rotation(cfg, fleet) == ["spark1", "spark2"]
    assert gateway.nodes_in_rotation(cfg) == []  # without the fleet: owned entries only
    assert pools(cfg, fleet) == BOTH
    # An owned entry routes to its owner whatever its api_base says.
    owned = {"model_name": "fast", "litellm_params": {"api_base": f"http://{IP2}:8000/v1"},
             "model_info": {gateway.OWNER_TAG: "spark1"}}
    assert gateway.route(owned, fleet) == "spark1"
    view = gateway.owned_view(cfg, fleet)
    assert view["operator_entries"] == ["embed"] and len(view["routes_not_owned"]) == 6


# -- the runbook's config, line for line -------------------------------------------------------------


@pytest.mark.parametrize("indent", [2, 0])
def test_the_runbook_config_reads_back_byte_for_byte(fleet, indent):
    text = text_of(indent)
    doc = gateway.parse(text)
    assert doc.text() == text and not doc.lossy
    assert pools(doc.config, fleet) == BOTH


@pytest.mark.parametrize("indent", [2, 0])
def test_drain_takes_the_node_out_of_every_hand_route_and_restore_puts_back_the_same_bytes(fleet, indent):
    text = text_of(indent)
    doc = gateway.parse(text)
    drained = gateway.drain(doc, fleet, "spark2", "bench_results run 1a2b since 2026-12-03T11:00:00Z")
    out = drained.text()
    assert pools(drained.config, fleet) == {"fast": ["spark1"], "reasoning": ["spark1"], "code": ["spark1"]}
    assert gateway.load_drains(out) == {"spark2": "bench_results run 1a2b since 2026-12-03T11:00:00Z"}
    # The stashed lines are the entries' own, commented out where they were, with their comment.
    stash = [line for line in out.splitlines() if line.startswith(gateway.STASH)]
    assert len(stash) == 1 + 3 * 7 and "# spark2 entries (identical, different api_base)" in stash[0]
    assert all(line.startswith(f"{gateway.STASH}spark2 | ") for line in stash)
    # Every other line as it was, in its place (the spark1 comment, the operator's entry and settings).
    kept = [line for line in body(out) if not line.startswith(gateway.STASH)]
    start, end = spark2_block(text)
    assert kept == text.splitlines()[:start] + text.splitlines()[end:]
    restored = gateway.restore(drained, fleet, "spark2")
    assert restored.text() == text
    # The same through a file that was written and read back (the stash survives the process).
    assert gateway.restore(gateway.parse(out), fleet, "spark2").text() == text
    assert len(drained.report.stashed) == 3 and len(restored.report.unstashed) == 3


def spark2_block(text: str) -> tuple[int, int]:
    """Where the runbook's spark2 block (its comment and its three entries) lies: [start, end)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "# spark2 entries" in line)
    return start, 1 + max(i for i, line in enumerate(lines) if "spark2-qwen35-122b-code" in line)


def test_two_nodes_drained_and_restored_in_any_order(fleet):
    text = text_of()
    doc = gateway.parse(text)
    both = gateway.drain(gateway.drain(doc, fleet, "spark1", "a"), fleet, "spark2", "b")
    assert gateway.routes(both.config, fleet) == {} and [x["model_name"] for x in both.config["model_list"]] == ["embed"]
    for first, second in (("spark1", "spark2"), ("spark2", "spark1")):
        one = gateway.restore(both, fleet, first)
        assert gateway.nodes_in_rotation(one.config, fleet) == [first]
        assert gateway.restore(gateway.parse(one.text()), fleet, second).text() == text


def test_all_entries_stashed_leaves_a_config_litellm_reads(fleet):
    text = runbook_config(IP1, IP2)
    doc = gateway.drain(gateway.drain(gateway.parse(text), fleet, "spark1"), fleet, "spark2")
    assert doc.config["model_list"] is None  # LiteLLM: `if model_list:` - nothing to serve, no crash
    back = gateway.restore(gateway.restore(gateway.parse(doc.text()), fleet, "spark2"), fleet, "spark1")
    assert back.text() == text


def test_restore_renders_stale_owned_entries_but_puts_hand_entries_back_as_they_were(fleet, seed_data):
    taken, _ = gateway.take_over(gateway.parse(text_of()), fleet)
    hand = gateway.parse(text_of())
    seed_data["launch"]["port"] = 8001  # the fleet file changed while the node was out
    moved = parse_fleet(seed_data)
    # Owned: rendered afresh on the new port. Hand-written: the operator's, back as they were.
    owned_back = gateway.restore(gateway.drain(taken, fleet, "spark2"), moved, "spark2")
    assert {x["litellm_params"]["api_base"] for x in owned_back.config["model_list"][3:6]} == {f"http://{IP2}:8001/v1"}
    assert len(owned_back.report.rewritten) == 3 and "# spark2 entries" in owned_back.text()
    hand_back = gateway.restore(gateway.drain(hand, fleet, "spark2"), fleet, "spark2")
    assert hand_back.text() == hand.text()


def test_a_route_the_drain_cannot_tell_refuses_naming_the_entry(fleet):
    text = text_of().replace(f"api_base: http://{IP2}:8000/v1\n      api_key: \"dummy\"\n    model_info:\n"
                             "      id: spark2-qwen35-122b-code", "api_base: os.environ/SPARK2_URL\n      api_key: "
                             "\"dummy\"\n    model_info:\n      id: spark2-qwen35-122b-code")
    doc = gateway.parse(text)
    with pytest.raises(gateway.RouteUnaccounted) as e:
        gateway.drain(doc, fleet, "spark1")
    assert "model_list[5]" in str(e.value) and "os.environ/SPARK2_URL" in str(e.value) and "spark2-qwen35-122b-code" in str(e.value)
    assert isinstance(e.value, gateway.RotationRefused)
    # An env-referenced api_base serving another model is the operator's business.
    other = text_of().replace("api_base: http://192.0.2.99:8080/v1", "api_base: os.environ/EMBED_URL")
    assert gateway.drain(gateway.parse(other), fleet, "spark1").config


# -- take-over -------------------------------------------------------------------------------------


def test_take_over_marks_each_runbook_entry_in_place_and_changes_nothing_else(fleet):
    text = text_of()
    doc = gateway.parse(text)
    taken, report = gateway.take_over(doc, fleet)
    diff = [d for d in difflib.ndiff(text.splitlines(), taken.text().splitlines()) if d[:1] in "+-"]
    assert diff == [f"+       {gateway.OWNER_TAG}: {n}" for n in ["spark1"] * 3 + ["spark2"] * 3]
    assert [gateway.owner(x) for x in taken.config["model_list"]] == ["spark1"] * 3 + ["spark2"] * 3 + [None]
    assert [(r["index"], r["node"], r["pool"]) for r in report.taken_over] == [
        (0, "spark1", "fast"), (1, "spark1", "reasoning"), (2, "spark1", "code"),
        (3, "spark2", "fast"), (4, "spark2", "reasoning"), (5, "spark2", "code")]
    assert report.routes_before == report.routes_after and not report.collapsed and not report.differing
    again, second = gateway.take_over(taken, fleet)
    assert again.text() == taken.text() and not second.taken_over  # idempotent
    # The gateway step on an adopted config rewrites nothing.
    assert gateway.rotate(taken, fleet, ["spark1", "spark2"]).text() == taken.text()


def test_take_over_reports_differing_routes_field_by_field_and_leaves_them_the_operators(fleet):
    text = text_of().replace("id: spark2-qwen35-122b-code", "id: spark2-code-by-hand").replace(
        "      api_key: \"dummy\"\n    model_info:\n      id: spark1-qwen35-122b-fast",
        "      api_key: sk-secret-literal\n      timeout: 600\n    model_info:\n      id: spark1-qwen35-122b-fast")
    taken, report = gateway.take_over(gateway.parse(text), fleet)
    assert len(report.taken_over) == 4
    rows = {(r["node"], r["pool"]): r for r in report.differing}
    assert set(rows) == {("spark1", "fast"), ("spark2", "code")}
    assert [f[0] for f in rows[("spark1", "fast")]["fields"]] == ["litellm_params.api_key", "litellm_params.timeout"]
    assert rows[("spark2", "code")]["fields"] == [["model_info.id", "spark2-code-by-hand", "spark2-qwen35-122b-code"]]
    assert "sk-secret-literal" not in "\n".join(report.lines()) and "dummy" not in str(report.as_dict())
    assert gateway.owner(taken.config["model_list"][0]) is None and gateway.owner(taken.config["model_list"][5]) is None
    # Still the node's routes: drained with it.
    assert gateway.nodes_in_rotation(gateway.drain(taken, fleet, "spark1").config, fleet) == ["spark2"]
    # The gateway step adds no second route beside them: each node once per pool.
    out = gateway.rotate(gateway.parse(text), fleet, ["spark1", "spark2"])
    assert len(out.config["model_list"]) == 7 and pools(out.config, fleet) == BOTH
    assert not out.report.added and len(out.report.differing) == 2


def test_duplicate_routes_of_the_old_bug_collapse_to_the_hand_entries(fleet):
    """gateway_job once wrote its six entries beside the six hand ones, same ids."""
    text = text_of()
    owned = gateway.dump_yaml([x for n in fleet.serve_nodes for x in gateway.node_entries(fleet, n)])
    bugged = text.replace("litellm_settings:", "".join(f"  {line}\n" for line in owned.splitlines()) + "litellm_settings:")
    doc = gateway.parse(bugged)
    assert len(doc.config["model_list"]) == 13 and pools(doc.config, fleet) == BOTH
    taken, report = gateway.take_over(doc, fleet)
    assert len(report.collapsed) == 6 and len(report.taken_over) == 6
    assert [r["index"] for r in report.collapsed] == [7, 8, 9, 10, 11, 12]
    assert [r["kept"] for r in report.collapsed] == [0, 1, 2, 3, 4, 5]
    assert taken.text() == gateway.take_over(gateway.parse(text), fleet)[0].text()
    # The gateway step mends it the same way.
    assert gateway.rotate(doc, fleet, ["spark1", "spark2"]).text() == taken.text()


def test_the_gateway_step_takes_over_instead_of_duplicating(fleet):
    text = text_of()
    out = gateway.rotate(gateway.parse(text), fleet, ["spark1", "spark2"])
    assert len(out.config["model_list"]) == 7 and not out.report.added and len(out.report.taken_over) == 6
    assert "# spark1 entries" in out.text() and "# keep this comment" in out.text() and 'api_key: "dummy"' in out.text()
    assert gateway.render_config(fleet, ["spark1", "spark2"], gateway.load(text))["model_list"] == out.config["model_list"]
    # A node left out is stashed like a drain (its hand routes too) and comes back the same.
    one = gateway.rotate(out, fleet, ["spark1"])
    assert pools(one.config, fleet) == {"fast": ["spark1"], "reasoning": ["spark1"], "code": ["spark1"]}
    assert gateway.rotate(one, fleet, ["spark1", "spark2"]).text() == out.text()


def test_a_missing_pool_gets_an_owned_entry_beside_the_nodes_others(fleet):
    text = text_of().replace("  - model_name: code\n    litellm_params:\n      model: openai/qwen35-hybrid-v2\n"
                             f"      api_base: http://{IP1}:8000/v1\n      api_key: \"dummy\"\n    model_info:\n"
                             "      id: spark1-qwen35-122b-code\n", "")
    out = gateway.rotate(gateway.parse(text), fleet, ["spark1", "spark2"])
    assert [(gateway.route(x, fleet), x["model_name"]) for x in out.config["model_list"][:6]] == [
        ("spark1", "fast"), ("spark1", "reasoning"), ("spark1", "code"),
        ("spark2", "fast"), ("spark2", "reasoning"), ("spark2", "code")]
    assert [r["pool"] for r in out.report.added] == ["code"]
    assert out.text().index("spark1-qwen35-122b-code") < out.text().index("# spark2 entries")


# -- text that is not the usual shape ----------------------------------------------------------------


def test_crlf_file_keeps_its_line_ends(fleet):
    text = text_of().replace("\n", "\r\n")
    doc = gateway.parse(text)
    assert doc.text() == text
    drained = gateway.drain(doc, fleet, "spark2", "x")
    assert all(line.endswith("\r") for line in drained.text().split("\n")[:-1])
    assert gateway.restore(drained, fleet, "spark2").text() == text
    taken, _ = gateway.take_over(doc, fleet)
    assert all(line.endswith("\r") for line in taken.text().split("\n")[:-1])


def test_flow_style_model_list_is_rewritten_as_a_dump_and_says_so(fleet):
    text = "# mine\nmodel_list: [{model_name: fast, litellm_params: {model: openai/qwen35-hybrid-v2, " \
           f"api_base: 'http://{IP1}:8000/v1', api_key: dummy}}, model_info: {{id: spark1-qwen35-122b-fast}}}}]\n"
    doc = gateway.parse(text)
    assert doc.lossy and doc.text() == text  # untouched: as it was
    drained = gateway.drain(doc, fleet, "spark1")
    assert drained.config.get("model_list") is None or drained.config["model_list"] == []
    back = gateway.restore(drained, fleet, "spark1")
    assert back.config["model_list"][0] == gateway.load(text)["model_list"][0]  # the hand entry, back first
    assert [r["pool"] for r in back.report.added] == ["reasoning", "code"]  # and the pools it lacked


def test_a_stash_broken_by_hand_is_one_clear_line(fleet):
    drained = gateway.drain(gateway.parse(text_of()), fleet, "spark2").text()
    lines = drained.split("\n")
    k = next(i for i, line in enumerate(lines) if "spark2-qwen35-122b-fast" in line)
    lines[k] = lines[k].split(" | ", 1)[1]  # one line of a stashed entry un-commented
    with pytest.raises(ValueError, match="partly commented out by spark-pipelines"):
        gateway.parse("\n".join(lines))


def test_a_config_without_model_list_gets_one(fleet):
    text = "# operator settings only\ngeneral_settings:\n  master_key: os.environ/K  # mine\n"
    out = gateway.rotate(gateway.parse(text), fleet, ["spark1"])
    assert out.text().startswith(text) and gateway.nodes_in_rotation(out.config, fleet) == ["spark1"]
    empty = "model_list: []  # filled by spark-pipelines\n"
    out = gateway.rotate(gateway.parse(empty), fleet, ["spark2"])
    assert out.text().startswith("model_list:  # filled by spark-pipelines\n")
    assert gateway.nodes_in_rotation(out.config, fleet) == ["spark2"]


def test_gateway_metadata_tells_hand_routes_from_operator_entries(fleet):
    """A reader is never told 'operator entries kept: 7' while six of them are routes to the fleet."""
    from spark_pipelines.assets.gateway import pool_rows

    hand = gateway.load(text_of())
    view = gateway.owned_view(hand, fleet)
    assert view["operator_entries"] == ["embed"] and len(view["routes_not_owned"]) == 6
    assert view["routes_not_owned"][0] == "fast -> spark1 (id spark1-qwen35-122b-fast)"
    rows = pool_rows(hand, fleet)
    assert [(r["node"], r["entry"]) for r in rows] == [("spark1", "operator")] * 3 + [("spark2", "operator")] * 3
    taken = gateway.rotate(gateway.parse(text_of()), fleet, ["spark1", "spark2"])
    assert {r["entry"] for r in pool_rows(taken.config, fleet)} == {"spark-pipelines"}
    assert gateway.owned_view(taken.config, fleet)["routes_not_owned"] == []
    assert len(taken.report.taken_over) == 6 and "sk-operator-literal" not in "\n".join(taken.report.lines())


def _entry(kind: str, node: str, pool: str, indent: int) -> str:
    i = " " * indent
    ip = {"spark1": IP1, "spark2": IP2}[node]
    if kind == "operator":
        return f"{i}- model_name: {pool}\n{i}  litellm_params:\n{i}    model: openai/x\n{i}    api_base: http://192.0.2.99/v1\n"
    mark = f"\n{i}    {gateway.OWNER_TAG}: {node}" if kind == "owned" else ""
    key = '"dummy"' if kind == "hand" else "dummy  # the operator's key"
    return (f"{i}- model_name: {pool}\n{i}  litellm_params:\n{i}    model: openai/qwen35-hybrid-v2\n"
            f"{i}    api_base: http://{ip}:8000/v1/\n{i}    api_key: {key}\n{i}  model_info:\n"
            f"{i}    id: {node}-qwen35-122b-{pool}{mark}\n")


def test_drain_then_restore_is_restore_alone_whatever_the_file(fleet):
    """Property: for any mix of hand, owned and operator entries with comments between them, a
    drain followed by a restore of the same node gives the text a restore alone gives (nothing
    lost, nothing moved), whichever other node is drained meanwhile."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    entry = st.tuples(st.sampled_from(["hand", "owned", "operator"]), st.sampled_from(["spark1", "spark2"]),
                      st.sampled_from(["fast", "reasoning", "code", "other"]),
                      st.sampled_from(["", "# a comment\n", "\n", "# one\n# two\n"]))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(entry, max_size=8), st.sampled_from([0, 2]), st.sampled_from(["spark1", "spark2"]), st.booleans())
    def check(entries, indent, node, other_first):
        text = "# top\nmodel_list:\n" + "".join(" " * indent * bool(c.strip()) + c + _entry(k, n, p, indent)
                                               for k, n, p, c in entries) + "router_settings: {}\n"
        doc = gateway.parse(text)
        assert doc.text() == text
        other = "spark2" if node == "spark1" else "spark1"
        d = gateway.drain(doc, fleet, node, "x")
        assert node not in gateway.nodes_in_rotation(d.config, fleet)
        assert gateway.parse(d.text()).text() == d.text()
        if other_first:
            d = gateway.drain(d, fleet, other)
        back = gateway.restore(gateway.parse(d.text()), fleet, node)
        if other_first:
            back = gateway.restore(back, fleet, other)
            assert back.text() == gateway.restore(gateway.restore(doc, fleet, node), fleet, other).text()
        else:
            assert back.text() == gateway.restore(doc, fleet, node).text()

    check()


def test_take_over_and_the_gateway_step_are_stable_whatever_the_file(fleet):
    """Property: take_over never changes which nodes each pool routes to, and only adds owner lines
    or removes duplicate entries; the gateway step run twice writes nothing the second time and
    leaves each node in each pool exactly once where no operator's differing route is."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    entry = st.tuples(st.sampled_from(["hand", "owned", "operator"]), st.sampled_from(["spark1", "spark2"]),
                      st.sampled_from(["fast", "reasoning", "code", "other"]),
                      st.sampled_from(["", "# a comment\n", "\n"]))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(entry, max_size=8), st.sampled_from([0, 2]))
    def check(entries, indent):
        text = "model_list:\n" + "".join(" " * indent * bool(c.strip()) + c + _entry(k, n, p, indent)
                                         for k, n, p, c in entries)
        doc = gateway.parse(text)
        taken, rep = gateway.take_over(doc, fleet)
        assert pools(taken.config, fleet) == pools(doc.config, fleet)
        assert len(taken.items()) == len(doc.items()) - len(rep.collapsed)
        if not rep.collapsed:  # then the only change is one owner line per entry taken over
            diff = [d for d in difflib.ndiff(text.splitlines(), taken.text().splitlines()) if d[:1] in "+-"]
            assert len(diff) == len(rep.taken_over) and all(
                d[1:].strip() in (f"{gateway.OWNER_TAG}: spark1", f"{gateway.OWNER_TAG}: spark2") for d in diff), diff
        once = gateway.rotate(doc, fleet, ["spark1", "spark2"])
        assert gateway.rotate(once, fleet, ["spark1", "spark2"]).text() == once.text()
        counts: dict[tuple[str, str], int] = {}
        for e in once.config["model_list"]:
            if gateway.owner(e):
                counts[(gateway.owner(e), e["model_name"])] = counts.get((gateway.owner(e), e["model_name"]), 0) + 1
        assert all(v == 1 for v in counts.values()), counts
        # An owned entry outside the gateway pools is dropped; a hand route there is the operator's.
        other = sorted({n for k, n, p, _ in entries if k == "hand" and p == "other"})
        assert pools(once.config, fleet) == {p: ["spark1", "spark2"] for p in ("fast", "reasoning", "code")} | (
            {"other": other} if other else {})

    check()
