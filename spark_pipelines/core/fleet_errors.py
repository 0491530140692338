"""How a refused fleet file reads: one line naming the field (dotted, with node names), the value
and what to write instead."""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import ValidationError

from spark_pipelines.core import names

_KEY = re.compile(r"[A-Za-z0-9_-]+")

# Fixes for pydantic's own messages, which say what is wrong but not what to write instead.
_HINTS = {
    "string_type": "write it as text (quote it)",
    "int_type": "write a whole number, without quotes",
    "int_parsing": "write a whole number, without quotes",
    "int_from_float": "write a whole number",
    "float_type": "write a number, without quotes",
    "float_parsing": "write a number, without quotes",
    "finite_number": "write a finite number (.nan and .inf are refused)",
    "bool_type": "write true or false",
    "bool_parsing": "write true or false",
    "tuple_type": "write a list",
    "list_type": "write a list",
    "dict_type": "write a mapping (key: value)",
    "model_type": "write a mapping (key: value)",
    "model_attributes_type": "write a mapping (key: value)",
    "greater_than": "use a value in range",
    "greater_than_equal": "use a value in range",
    "less_than": "use a value in range",
    "less_than_equal": "use a value in range",
    "string_too_long": "shorten it",
    "too_long": "shorten the list",
}


def one_line(text: str) -> str:
    return " ".join(text.split())


def render_path(loc: tuple[Any, ...], data: Any = None) -> str:
    """`nodes[0] (spark1).overrides.env['BAD KEY']`: dotted, with node names, hostile keys repr'd."""
    parts: list[str] = []
    cur = data
    for item in loc:
        if isinstance(item, int) and not isinstance(item, bool):
            name = cur[item].get("name") if isinstance(cur, list) and 0 <= item < len(cur) and isinstance(cur[item], dict) else None
            ok = isinstance(name, str) and names.NODE_NAME.fullmatch(name)
            parts.append(f"[{item}]" + (f" ({name})" if ok else ""))
        elif isinstance(item, str) and _KEY.fullmatch(item):
            parts.append(("." if parts else "") + item)
        else:
            parts.append(f"[{names.shown(item)}]")
        try:
            cur = cur[item]
        except (KeyError, IndexError, TypeError):
            cur = None
    return "".join(parts)


def explain(err: ValidationError, data: Any) -> str:
    """The first problem as one line (field, value, fix), then how many more there are."""
    lines = []
    errors = err.errors()
    missing: dict[tuple, list[str]] = {}  # parent path -> the fields missing there
    for e in errors:
        if e["type"] == "missing" and e["loc"] and isinstance(e["loc"][-1], str):
            missing.setdefault(tuple(e["loc"][:-1]), []).append(e["loc"][-1])
    # An unknown key first: a misspelt key is also a missing one, and the misspelling is the fix.
    for e in sorted(errors, key=lambda e: e["type"] != "extra_forbidden"):
        loc = render_path(tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-"))), data)
        msg = e["msg"].removeprefix("Value error, ")
        val = e.get("input")
        if e["type"] == "extra_forbidden":
            key = e["loc"][-1] if e["loc"] else ""
            near = difflib.get_close_matches(str(key), missing.get(tuple(e["loc"][:-1]), []), n=1, cutoff=0.6)
            msg = (f"unknown key; did you mean {near[0]!r}? Rename it" if near
                   else "unknown key (typo?); remove it or check the spelling")
        elif e["type"] == "missing":
            msg = "required field is missing; add it"
        elif e["type"] in _HINTS:
            if isinstance(val, bool) and e["type"] not in ("bool_type", "bool_parsing"):
                msg += f"; YAML read it as a boolean: {_HINTS[e['type']]}"
            else:
                msg += f"; {_HINTS[e['type']]}"
        shown = names.shown(val) if not isinstance(val, (dict, list)) else f"(a {'mapping' if isinstance(val, dict) else 'list'})"
        # A None is a section left out (a default checked): "= None" would say nothing more.
        value = "" if e["type"] in ("missing", "extra_forbidden") or val is None or shown in msg else f" = {shown}"
        lines.append(one_line(f"{loc}{value}: {msg}" if loc else msg))
    more = f" (and {len(lines) - 1} more: fix this one and load again)" if len(lines) > 1 else ""
    return lines[0] + more
