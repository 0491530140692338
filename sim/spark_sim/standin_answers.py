"""What the vLLM stand-in answers, per request (standard library only: it runs in the image).

A healthy deployment of the patched image answers what a 122B model answers to simple, checkable
requests: arithmetic, a tool call when a tool fits the question (arguments taken from the
question), an answer from a tool's result. Rules, not a model: deterministic, like temperature 0,
and enough for the quality suite to score a good node high. Anything else (the recipe's long
prompts) gets None: the stand-in then emits its word stream as before.

Answer modes (env SIM_ANSWERS of the container: the launch's env, so a rollout can carry one):
- "healthy" (default);
- "garbage": the unpatched image of the runbook's troubleshooting table ("Garbage output ->
  ensure the patched image"): fast, fluent-looking, wrong: never an answer, never a tool call;
- "broken-tools": answers right, but tool calls come out as text in the content (what a missing
  or mismatched --tool-call-parser does), never as tool_calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

MODES = ("healthy", "garbage", "broken-tools")
THINK_TOKENS = 24  # thinking before a rule answer (working included)
_ARITH = re.compile(r"(-?\d+)\s*([-+*x×/])\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_STOP = {"what", "when", "where", "which", "with", "that", "this", "from", "into", "your", "right", "current",
         "answer", "number", "only", "concise"}


class Answer:
    def __init__(self, content: str = "", reasoning: str = "", tool_call: tuple[str, str] | None = None) -> None:
        self.content, self.reasoning, self.tool_call = content, reasoning, tool_call


def mode_of(value: str | None) -> str:
    mode = (value or "healthy").strip().lower()
    return mode if mode in MODES else "healthy"


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 3 and w not in _STOP}


def _arith(text: str) -> tuple[str, str] | None:
    m = _ARITH.search(text)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op in "x×*":
        r = a * b
    elif op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    else:
        if b == 0:
            return None
        r = a / b
    return str(r), f"{a} {op} {b} = {r}."


def _pick_tool(text: str, tools: list) -> dict | None:
    """The tool whose name and description share the most words with the question (none shared:
    no tool fits, answer directly)."""
    asked = _words(text)
    best, best_n = None, 0
    for t in tools:
        fn = (t or {}).get("function") or {}
        n = len(asked & (_words(fn.get("name", "").replace("_", " ")) | _words(fn.get("description", ""))))
        if n > best_n:
            best, best_n = fn, n
    return best


def _arguments(text: str, fn: dict) -> dict:
    """Each parameter from the question, in order: an enum value it names (each used once, in the
    order they appear), a number, or a capitalised word that is not the sentence's first."""
    props = ((fn.get("parameters") or {}).get("properties")) or {}
    lowered = text.lower()
    used: set[str] = set()
    proper = [w for w in re.findall(r"(?<=\s)[A-Z][a-z]+", text)]
    numbers = _NUMBER.findall(text)
    out: dict = {}
    for name, spec in props.items():
        spec = spec or {}
        if spec.get("enum"):
            found = sorted((lowered.find(str(v).lower()), str(v)) for v in spec["enum"]
                           if str(v).lower() in lowered and str(v) not in used)
            if found:
                out[name] = found[0][1]
                used.add(found[0][1])
        elif spec.get("type") in ("number", "integer") and numbers:
            v = float(numbers.pop(0))
            out[name] = int(v) if v.is_integer() else v
        elif spec.get("type") == "string":
            free = [w for w in proper if w not in used]
            if free:
                out[name] = free[0]
                used.add(free[0])
    return out


def answer(messages: list, tools: list | None, mode: str, thinking: bool) -> Answer | None:
    """The answer to `messages`, or None where the rules have none (the word stream then)."""
    if mode == "garbage" or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") == "tool":
        result = str(last.get("content") or "")
        return Answer(f"The tool says: {result}.", "The tool returned the result; relay it." if thinking else "")
    if last.get("role") != "user":
        return None
    text = str(last.get("content") or "")
    fn = _pick_tool(text, tools or []) if tools else None
    if fn is not None:
        args = json.dumps(_arguments(text, fn))
        reasoning = f"The {fn.get('name')} tool answers this." if thinking else ""
        if mode == "broken-tools":  # the model's call format, unparsed, in the content
            return Answer(f'<tool_call>\n{{"name": "{fn.get("name")}", "arguments": {args}}}\n</tool_call>',
                          reasoning)
        return Answer("", reasoning, (str(fn.get("name")), args))
    done = _arith(text)
    if done is not None:
        result, working = done
        return Answer(result, working if thinking else "")
    return None


def plan(said: Answer, max_tokens: int, reasoning_tokens: int, forced: int,
         word: Callable[[int], str]) -> tuple[list[tuple[str, str]], str]:
    """The tokens of an answer, as (field, text) pieces, and its finish reason: thinking (the
    word stream `word(j)`, then the working) when on, the answer or the tool call's tokens, then
    the word stream again while ignore_eos/min_tokens (`forced`) ask for more: a forced length
    counts tokens after EOS too, as vLLM does."""
    tokens: list[tuple[str, str]] = []
    if reasoning_tokens and said.reasoning:
        working = re.findall(r"\s*\S+", said.reasoning)
        # An easy question takes little thinking: a few words before the working, not a quarter.
        tokens += [("reasoning_content", word(j)) for j in range(max(0, min(reasoning_tokens, THINK_TOKENS) - len(working)))]
        tokens += [("reasoning_content", w) for w in working]
    tokens += [("content", w) for w in re.findall(r"\s*\S+", said.content)]
    if said.tool_call is not None:
        tokens += [("tool", "")] * (3 + len(said.tool_call[1]) // 4)
    end = "tool_calls" if said.tool_call is not None else "stop"
    tokens += [("content", word(j)) for j in range(len(tokens), min(max(forced, 1), max_tokens))]
    if len(tokens) > max_tokens or forced >= max_tokens:
        end = "length"
    return tokens[:max_tokens], end
