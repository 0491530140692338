"""The soak's report a person reads: the timeline as a PNG (requests per second, failures by cause,
each node's state, faults and operator actions as marks), the per-fault table and the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spark_sim.soak import Soak


def _s(x: float | None, t0: float) -> str:
    return "-" if x is None else f"{x - t0:.0f}"


def fault_rows(soak: Soak) -> list[str]:
    t0 = soak.t0
    rows = ["| # | fault | node | at s | held s | detected after s | out of routes after s | settled after s | outcome |",
            "|---|---|---|---|---|---|---|---|---|"]
    faults = sorted((m for m in soak.marks if m.kind == "fault"), key=lambda m: m.start)
    for i, m in enumerate(faults, 1):
        held = "-" if m.end is None else f"{m.end - m.start:.0f}"
        det = "-" if m.detected is None else f"{m.detected - m.start:.0f}"
        out = "-" if m.out_at is None else f"{m.out_at - m.start:.0f}"
        st = "-" if m.settled is None else f"{m.settled - m.start:.0f}"
        rows.append(f"| {i} | {m.name} | {m.node} | {_s(m.start, t0)} | {held} | {det} | {out} | {st} | "
                    f"{m.outcome}{(': ' + m.detail[:160].replace('|', '/')) if m.detail else ''} |")
    return rows


def markdown(soak: Soak, result: dict[str, Any], png: str, command: str) -> str:
    t0 = soak.t0
    lines = [f"# Soak: seed {result['seed']}, {len(result['nodes'])} nodes, {result['duration_s']} s — "
             f"**{result['verdict']}**", "",
             f"Reproduce: `{command}`", "", f"![timeline]({png})", "",
             "## Requests (every client request, classified by the checker)", "",
             "| cause | requests |", "|---|---|"]
    for cause, n in sorted(result["causes"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cause} | {n} |")
    detail: dict[str, int] = {}
    for r in soak.requests:
        if r["cause"] != "served":
            detail[r["cause"]] = detail.get(r["cause"], 0) + 1
    if detail:
        lines += ["", "Failed, by fault or run: " + ", ".join(f"{k} {v}" for k, v in sorted(detail.items()))]
    bad = [r for r in soak.requests if r["cause"].startswith(("pipeline", "unexplained"))]
    for r in bad[:15]:
        lines.append(f"- {r['at'] - t0:.1f} s {r['kind']} via {r['node'] or '?'}: {r['cause']}: {r['error'][:150]}")
    lines += ["", f"Gateway routes sampled (the proxy's /model/info, 1 s): {result['route_samples']} answered, "
              f"{result['route_unanswered']} unanswered (proxy down or reloading), "
              f"{len(result['empty_samples'])} empty"
              + (f" (at {', '.join(str(x) for x in result['empty_samples'][:8])} s)" if result['empty_samples'] else "")
              + f"; routed to a node down longer than the detection time ({result['detect_budget_s']} s): "
              f"{len(result['stale_routes'])}" + (f" ({'; '.join(result['stale_routes'][:3])})" if result['stale_routes'] else "")
              + ". Engines replaced while routed with no fault on their node (the pipeline stopping a "
              f"routed engine): {len(result['replaced_while_routed'])}"
              + (f" ({'; '.join(result['replaced_while_routed'][:3])})" if result['replaced_while_routed'] else "")
              + ".", "",
              "## Faults (" + ", ".join(f"{k} {v}" for k, v in sorted(result["faults_by_kind"].items())) + ")", "",
              *fault_rows(soak), "", "## Operator actions and pipeline runs", "",
              "| at s | what | node | took s | ok | by / detail |", "|---|---|---|---|---|---|"]
    for m in sorted((m for m in soak.marks if m.kind in ("action", "run")), key=lambda m: m.start):
        took = "-" if m.end is None else f"{m.end - m.start:.0f}"
        lines.append(f"| {_s(m.start, t0)} | {m.kind} {m.name} | {m.node or ''} | {took} | "
                     f"{'' if m.ok is None else 'yes' if m.ok else 'NO'} | {m.detail[:160].replace('|', '/')} |")
    end = result["end"]
    lines += ["", "## End state", ""]
    for n, st in end["nodes"].items():
        lines.append(f"- {n}: {st['state']}; containers {', '.join(st['containers']) or 'none'}; "
                     f"run lease {'HELD' if st['lease_held'] else 'free'}")
    lines += [f"- runs left STARTED: {end['started_runs']}; pipeline runs ok {result['runs']['ok']}, "
              f"failed {result['runs']['failed']}", "", "## Verdict", "",
              result["verdict"] + (": " + "; ".join(result["problems"]) if result["problems"] else
                                   ": no request failed by the pipeline's own action, the gateway never empty, "
                                   "every node serving and routed or out with a ledger reason")]
    return "\n".join(lines) + "\n"


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = soak.t0
    end = max(soak.t_end - t0, 1.0)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(14, 4 + 0.5 * len(soak.nodes)), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1 + 0.25 * len(soak.nodes)]})
    bins = int(end // 5) + 1
    served = [0] * bins
    failed: dict[str, list[int]] = {}
    for r in soak.requests:
        b = min(bins - 1, max(0, int((r["end"] - t0) // 5)))
        if r["cause"] == "served":
            served[b] += 1
        else:
            failed.setdefault(r["cause"].split(":")[0], [0] * bins)[b] += 1
    xs = [i * 5 for i in range(bins)]
    ax1.plot(xs, [v / 5 for v in served], color="tab:green", label="served /s")
    colors = {"fault": "tab:orange", "compound": "tab:brown", "pipeline": "tab:red", "unexplained": "black"}
    for cause, ys in failed.items():
        ax1.bar(xs, [v / 5 for v in ys], width=4, color=colors.get(cause, "gray"), alpha=0.8,
                label=f"failed ({cause}) /s")
    for m in soak.marks:
        if m.kind == "action":
            ax1.axvline(m.start - t0, color="tab:blue", ls="--", lw=0.8)
            ax1.text(m.start - t0, ax1.get_ylim()[1] * 0.95, m.name, color="tab:blue", fontsize=7, rotation=90,
                     va="top")
    ax1.set_ylabel("requests / s")
    ax1.legend(loc="upper right", fontsize=7)
    lanes = [*soak.nodes, "gateway"]
    for i, n in enumerate(lanes):
        y = len(lanes) - 1 - i
        if n != "gateway":
            routed_iv = _intervals([(t - t0, nodes is not None and n in nodes) for t, nodes in soak.routes], end)
            for a, b in routed_iv:
                ax2.broken_barh([(a, b - a)], (y - 0.35, 0.3), color="tab:green")
            up = _intervals([(t - t0, ok) for t, name, ok in soak.health if name == n], end)
            for a, b in up:
                ax2.broken_barh([(a, b - a)], (y + 0.05, 0.3), color="tab:olive")
        else:
            empty = _intervals([(t - t0, nodes is not None and not nodes) for t, nodes in soak.routes], end)
            for a, b in empty:
                ax2.broken_barh([(a, b - a)], (y - 0.35, 0.7), color="black")
        for m in soak.marks:
            if m.node != n:
                continue
            if m.kind == "fault":
                stop = (m.settled or m.end or soak.t_end) - t0
                ax2.broken_barh([(m.start - t0, max(stop - (m.start - t0), 1))], (y - 0.45, 0.9),
                                facecolor="none", edgecolor="tab:red", lw=1)
                ax2.text(m.start - t0, y + 0.38, m.name, fontsize=6, color="tab:red")
            elif m.kind == "run":
                ax2.plot([m.start - t0, (m.end or soak.t_end) - t0], [y - 0.42, y - 0.42], color="tab:purple", lw=2)
    ax2.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax2.set_xlabel("seconds since the soak started")
    ax2.set_title("per node: engine /health up (olive, top), routed by the proxy (green, bottom), runs (purple), "
                  "faults (red boxes); gateway lane: empty routes (black)", fontsize=8)
    ax2.set_xlim(0, end)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _intervals(samples: list[tuple[float, bool]], end: float) -> list[tuple[float, float]]:
    out, start = [], None
    for t, on in samples:
        if on and start is None:
            start = t
        elif not on and start is not None:
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, end))
    return out


def write(soak: Soak, result: dict[str, Any], out_dir: Path, name: str, command: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    plot(soak, png)
    md = out_dir / f"{name}.md"
    md.write_text(markdown(soak, result, png.name, command))
    soak.dump(out_dir / f"{name}.json")
    return md
