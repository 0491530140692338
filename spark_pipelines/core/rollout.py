"""A new image or checkpoint reaches the fleet as a rollout: a canary first, then waves.

Pure planning and gating. The canary node goes alone; each later wave takes at most
`max_unavailable` nodes, so the gateway never holds fewer than N - max_unavailable of the nodes
that were serving (and never fewer than gateway.min_in_rotation). Every node of a wave must pass
the gates (healthy and serving the new deployment, then the bench against its floor, the MTP
acceptance floor and the fleet's baseline on the previous version) before the next wave starts.
A failed gate stops the rollout; the failed nodes go back to their previous deployment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from spark_pipelines.core.errors import first_line
from spark_pipelines.core.gate import GateResult


class RolloutRefused(ValueError):
    """The rollout cannot start as asked; the message says why and what to change."""


@dataclass(frozen=True)
class Wave:
    index: int  # 0 is the canary
    nodes: tuple[str, ...]

    @property
    def canary(self) -> bool:
        return self.index == 0

    def label(self) -> str:
        return "canary" if self.canary else f"wave {self.index}"


@dataclass(frozen=True)
class RolloutPlan:
    waves: tuple[Wave, ...]
    skipped: Mapping[str, str]  # node -> why it is not part of this rollout
    max_unavailable: int
    floor_in_rotation: int  # the rotation never goes below this while the rollout runs

    def text(self) -> str:
        lines = [f"{w.label()}: {', '.join(w.nodes)}" for w in self.waves]
        lines += [f"skipped {n}: {why}" for n, why in self.skipped.items()]
        lines.append(f"at most {self.max_unavailable} node(s) out of the gateway at a time; "
                     f"the rotation keeps at least {self.floor_in_rotation}")
        return "\n".join(lines)


def plan_waves(nodes: Sequence[str], *, in_rotation: Sequence[str], max_unavailable: int = 1,
               min_in_rotation: int = 1, canary: str | None = None,
               skip: Mapping[str, str] | None = None) -> RolloutPlan:
    """Order the nodes into waves. `in_rotation`: the nodes serving through the gateway now (a
    node out of it costs the rotation nothing when it is redeployed, so it may join any wave
    beyond the max_unavailable count). `skip`: nodes kept out of the rollout (quarantined, ...)."""
    skip = dict(skip or {})
    targets = [n for n in nodes if n not in skip]
    if not targets:
        raise RolloutRefused("no node to roll out to" + (f" (skipped: {', '.join(skip)})" if skip else ""))
    if max_unavailable < 1:
        raise RolloutRefused(f"rollout.max_unavailable is {max_unavailable}: at least 1 node must be allowed out")
    serving = [n for n in in_rotation if n in nodes]
    floor = max(min_in_rotation, len(serving) - max_unavailable)
    room = len(serving) - floor  # serving nodes that may be out at once
    if serving and room < 1 and any(n in serving for n in targets):
        raise RolloutRefused(
            f"{len(serving)} node(s) serve ({', '.join(serving)}) and gateway.min_in_rotation is {min_in_rotation}: "
            f"taking one out for its deploy would leave fewer; add a node or lower gateway.min_in_rotation")
    first = canary or next((n for n in targets if n in serving), targets[0])
    if first not in targets:
        why = skip.get(first, "not a serve node of this fleet")
        raise RolloutRefused(f"rollout.canary {first!r} cannot be the canary: {why}")
    rest = [n for n in targets if n != first]
    waves = [Wave(0, (first,))]
    # Nodes out of the rotation go first after the canary: deploying them costs no capacity.
    rest.sort(key=lambda n: n in serving)
    wave: list[str] = []
    used = 0
    for n in rest:
        cost = 1 if n in serving else 0
        if wave and (len(wave) >= max_unavailable or used + cost > room):
            waves.append(Wave(len(waves), tuple(wave)))
            wave, used = [], 0
        wave.append(n)
        used += cost
    if wave:
        waves.append(Wave(len(waves), tuple(wave)))
    return RolloutPlan(tuple(waves), skip, max_unavailable, floor)


# -- executing a plan --------------------------------------------------------------------------

WAITING, DEPLOYING, GATING, PASSED, FAILED, REVERTED, REVERT_FAILED, NOT_STARTED = (
    "waiting", "deploying", "gating", "passed", "failed", "rolled back", "rollback FAILED", "not started")


@dataclass
class NodeStep:
    """One node's place in a running rollout (a row of the UI's table)."""

    node: str
    wave: str
    before: str  # the version it ran when the rollout started
    state: str = WAITING
    now: str = ""  # the version it runs now
    gate: str = ""
    why: str = ""


class RolloutSteps(Protocol):
    """What the rollout does on one node; each step is the node's own transaction."""

    def deploy(self, node: str) -> str:
        """Deploy the new version, keeping the previous one; returns the new version. Raises on a
        failed deploy, which has already rolled itself back (health gate failed)."""

    def gate(self, node: str) -> GateResult:
        """Bench the deployed node and judge it (core.gate.judge)."""

    def revert(self, node: str, why: str) -> str:
        """Put the previous version back on a committed node; returns what happened (a node
        whose deploy did not commit, and so put itself back, has nothing to revert)."""

    def finish(self, node: str) -> str:
        """The rollout is over for a node on its new version: drop what was kept."""


@dataclass
class RolloutOutcome:
    steps: list[NodeStep]
    completed: bool
    failed_gate: GateResult | None = None
    stopped_at: str = ""  # the wave that failed
    skipped: Mapping[str, str] = field(default_factory=dict)  # node -> why the plan left it out

    def headline(self) -> str:
        if self.completed:
            return (f"rolled out to {', '.join(s.node for s in self.steps if s.state == PASSED)}"
                    + "".join(f"; skipped {n}: {why}" for n, why in self.skipped.items()))
        g = self.failed_gate
        assert g is not None
        left = [s.node for s in self.steps if s.state == NOT_STARTED]
        return (f"rollout stopped at the {self.stopped_at}: {g.node} failed the {g.gate} gate: {g.why}"
                + (f"; not started: {', '.join(left)}" if left else ""))


STEP_COLUMNS = (("node", "string", "serve node"), ("wave", "string", "canary or wave n"),
                ("before", "string", "version when the rollout started"), ("now", "string", "version it runs now"),
                ("state", "string", "where it is in the rollout"), ("gate", "string", "the gate that decided"),
                ("why", "string", "what the gate read"))


def rows(steps: Sequence[NodeStep]) -> list[dict[str, str]]:
    return [{"node": s.node, "wave": s.wave, "before": s.before, "now": s.now, "state": s.state,
             "gate": s.gate, "why": s.why[:300]} for s in steps]


def execute(plan: RolloutPlan, steps: RolloutSteps, versions: Mapping[str, str],
            on_progress: Callable[[str, list[NodeStep]], None] = lambda event, table: None,
            passed_before: Sequence[str] = ()) -> RolloutOutcome:
    """Run the plan: each node of a wave deployed then gated, one after the other; the next wave
    only when every node of this one passed. The first failed gate stops the rollout: the node is
    put back on its previous version (a failed deploy has put itself back) and no further node
    is touched. Every node that passed is finished (its kept version dropped), and so is each of
    `passed_before` (nodes a dead run of this rollout gated and never finished). On an interrupt
    the node being gated is put back too, the ones passed are finished, and it propagates."""
    table = [NodeStep(n, w.label(), versions.get(n, "?"), now=versions.get(n, "?")) for w in plan.waves for n in w.nodes]
    by_node = {s.node: s for s in table}
    outcome = RolloutOutcome(table, completed=False, skipped=dict(plan.skipped))

    def say(event: str) -> None:
        on_progress(event, table)

    def settle_passed() -> None:
        for st in table:
            if st.state == PASSED:
                try:
                    done = steps.finish(st.node)
                except Exception as e:  # the node serves its gated version either way
                    done = f"not finished ({first_line(e)})"
                st.why = f"{st.why}; {done}" if st.why else done
        for n in passed_before:
            try:
                done = steps.finish(n)
            except Exception as e:
                done = f"not finished ({first_line(e)})"
            say(f"{n} passed its gate in an earlier run of this rollout: {done}")

    def put_back(st: NodeStep, why: str) -> None:
        try:
            st.why = f"{why}; {steps.revert(st.node, why)}"
            st.state, st.now = REVERTED, st.before
        except Exception as e:
            st.state, st.why = REVERT_FAILED, f"{why}; the rollback failed: {first_line(e)}"

    try:
        for wave in plan.waves:
            say(f"{wave.label()} starts: {', '.join(wave.nodes)}")
            for n in wave.nodes:
                st = by_node[n]
                st.state = DEPLOYING
                say(f"{wave.label()}: deploying {n}")
                try:
                    st.now = steps.deploy(n)
                except Exception as e:
                    result = GateResult(n, False, "health", str(e))
                    st.state, st.gate, st.why = FAILED, "health", f"{e} (the deploy put the previous version back)"
                    st.now = st.before
                else:
                    st.state = GATING
                    say(f"{wave.label()}: {n} deployed ({st.now}); gating it")
                    try:
                        result = steps.gate(n)
                    except Exception as e:  # a bench that did not complete opens no gate
                        result = GateResult(n, False, "bench", f"the bench did not complete: {e}")
                    st.gate, st.why = result.gate, result.why
                    if result.passed:
                        st.state = PASSED
                    else:
                        st.state = FAILED
                        put_back(st, f"{result.gate} gate failed: {result.why}")
                say(f"{wave.label()}: {n} {st.state}")
                if not result.passed:
                    outcome.failed_gate, outcome.stopped_at = result, wave.label()
                    for later in table:
                        if later.state == WAITING:
                            later.state = NOT_STARTED
                    return outcome
        outcome.completed = True
        return outcome
    except BaseException:
        for st in table:
            if st.state == GATING:  # committed, never judged: it goes back
                put_back(st, "the rollout was interrupted before its gate")
            elif st.state == DEPLOYING:  # the interrupt may have landed just after the commit
                put_back(st, "the rollout was interrupted during its deploy")
            elif st.state == WAITING:
                st.state = NOT_STARTED
        raise
    finally:
        settle_passed()
        say("rollout " + ("completed" if outcome.completed else "stopped"))
