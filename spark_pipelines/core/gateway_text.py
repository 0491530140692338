"""The LiteLLM config as the operator wrote it: every rewrite keeps their lines.

A rewrite changes only the `model_list` entries it must; every other line (comments, blank lines,
key order, quoting, indentation, the operator's entries, the other top-level keys) keeps its bytes.
The file is cut into lines: the part before `model_list`'s items (`pre`), the item region (each
entry's own lines as an `Item`, the comment and blank lines between them as `Line`s) and the rest
(`post`). An entry's position is where its lines are.

Two kinds of lines are spark-pipelines' own, both comments (LiteLLM ignores them):
- drain notes, the first lines of the file: `# spark-pipelines drained <node>: <who> since <when>`;
- stash lines: an entry taken out of rotation stays where it was, each of its lines commented out
  as `# spark-pipelines stashed <node> | <the line as it was>` (with the comment lines directly
  above it, which describe it). A restore strips the prefix: the same bytes at the same place.
  Being in the config itself, a stash is written in the same atomic rename as the drain it
  belongs to, under the same lock, and survives the process that wrote it.

Where the text cannot be edited line for line (a flow-style `model_list: [...]`, anchors defined
inside an entry, unusual line breaks) the config is written as a fresh dump and `Doc.lossy` says
why: that rewrite loses comments (the file it replaces is kept as `<config>.previous`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

DRAIN_NOTE = "# spark-pipelines drained "  # header line: "<prefix><node>: <who> since <when>"
STASH = "# spark-pipelines stashed "  # "<prefix><node> | <original line>"
_STASH_RE = re.compile(r"^# spark-pipelines stashed (\S+) \|(?: )?(.*)$")
_NOTE_SAFE = re.compile(r"[^\w .:,/@()+=-]")


class _NoAliases(yaml.SafeDumper):
    """Entries that share objects are written out in full: an anchor in one entry and its alias
    in another would break the day one of them is stashed."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_NoAliases, sort_keys=False, default_flow_style=False, width=1 << 16)


def note_line(node: str, why: str) -> str:
    return f"{DRAIN_NOTE}{node}: {_NOTE_SAFE.sub('_', why)[:200]}"


def parse_notes(lines: list[str]) -> tuple[dict[str, str], list[str]]:
    """The drain notes in the file's first comment block, and the lines without them."""
    notes: dict[str, str] = {}
    rest: list[str] = []
    header = True
    for line in lines:
        if header and not line.startswith("#"):
            header = False  # only the header: an operator's comment further down is not a note
        if header and line.startswith(DRAIN_NOTE) and ":" in line[len(DRAIN_NOTE):]:
            node, why = line[len(DRAIN_NOTE):].split(":", 1)
            notes[node.strip()] = why.strip()
            continue
        rest.append(line)
    return notes, rest


@dataclass
class Line:
    """A comment or blank line (or, in `pre` / `post`, any line outside the item region)."""

    text: str
    out: str | None = None  # stashed under this node


@dataclass
class Item:
    """One model_list entry: its own lines (the first holds its `-`) and what they parse to."""

    lines: list[str]
    entry: Any
    out: str | None = None  # stashed under this node: the lines are commented out in the file


@dataclass
class Doc:
    notes: dict[str, str]
    pre: list[Line]
    region: list[Line | Item]
    post: list[Line]
    dash_col: int = 0  # where a new entry's `-` goes
    eol: str = ""  # "\r" in a CRLF file
    final_nl: bool = True
    key_missing: bool = False  # no model_list key yet: written before the first entry
    key_value: tuple[int, int, int] | None = None  # (pre index, start, end) of an empty value (`[]`, `null`)
    lossy: str = ""  # why this config could not be kept line for line (then: a fresh dump)
    original: str | None = None  # a lossy doc's text as read, written back while untouched
    touched: bool = False
    report: Any = None  # what the last transform did (core.gateway.Report)
    # id(item) -> its place among the entries when a transform began, for what it reports
    positions: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    # -- reading --

    def items(self) -> list[tuple[int, Item]]:
        return [(i, e) for i, e in enumerate(self.region) if isinstance(e, Item)]

    @property
    def config(self) -> dict[str, Any]:
        """What LiteLLM reads: the stashed entries are comments."""
        return load(self.text())

    def text(self) -> str:
        notes = [note_line(n, why) + self.eol for n, why in sorted(self.notes.items())]
        if self.original is not None and not self.touched:
            _, rest = parse_notes(self.original.split("\n"))
            return "\n".join(notes + rest)
        has_items = any(isinstance(e, Item) for e in self.region)
        out = list(notes)
        for i, line in enumerate(self.pre):
            text = line.text
            if has_items and self.key_value and self.key_value[0] == i:
                _, a, b = self.key_value
                text = text[:a].rstrip() + text[b:]
            out.append(_render(text, line.out))
        if self.key_missing and has_items:
            out.append("model_list:" + self.eol)
        for e in self.region:
            if isinstance(e, Item):
                out += [_render(t, e.out) for t in e.lines]
            else:
                out.append(_render(e.text, e.out))
        out += [_render(line.text, line.out) for line in self.post]
        return "\n".join(out) + ("\n" if self.final_nl else "")

    def copy(self) -> Doc:
        """A copy to transform; `positions` numbers its entries as they are now."""
        out = copy.deepcopy(self)
        out.positions = {id(it): k for k, (_, it) in enumerate(out.items())}
        return out

    def with_notes(self, notes: dict[str, str]) -> Doc:
        out = self.copy()
        out.notes = dict(notes)
        return out

    # -- changing (every change marks the doc touched) --

    def lead(self, i: int) -> list[int]:
        """The comment lines directly above entry `i` (no blank line between), stashed as it is:
        they describe it, travel with it into a stash and out of it, and stay above it when an
        entry is inserted before it."""
        out: list[int] = []
        mine = self.region[i].out
        j = i - 1
        while j >= 0:
            e = self.region[j]
            if not isinstance(e, Line) or e.out != mine or not e.text.strip() or not e.text.lstrip().startswith("#"):
                break
            out.insert(0, j)
            j -= 1
        return out

    def stash(self, i: int, node: str) -> None:
        for j in [*self.lead(i), i]:
            self.region[j].out = node
        self.touched = True

    def unstash(self, node: str) -> int:
        n = 0
        for e in self.region:
            if e.out == node:
                e.out = None
                n += isinstance(e, Item)
        self.touched = self.touched or n > 0
        return n

    def remove(self, i: int) -> None:
        """Drop entry `i`; the comment lines above it stay (comments are never dropped)."""
        del self.region[i]
        self.touched = True

    def insert(self, at: int, entry: Any) -> None:
        self.region.insert(at, Item(self._lines_for(entry), copy.deepcopy(entry)))
        self.touched = True

    def replace(self, i: int, entry: Any) -> None:
        item = self.region[i]
        assert isinstance(item, Item)
        item.lines = self._lines_for(entry)
        item.entry = copy.deepcopy(entry)
        self.touched = True

    def add_key(self, i: int, parent: str, key: str, value: str) -> None:
        """Add `key: value` to entry `i`'s `parent` mapping as one more line, the entry's other
        lines (comments, quoting) as they are; an entry whose mapping is not in block style is
        rewritten whole."""
        item = self.region[i]
        assert isinstance(item, Item)
        want = copy.deepcopy(item.entry)
        want[parent][key] = value
        lines = _with_key(item.lines, self.dash_col, parent, key, value, self.eol)
        if lines is None or _parse_item(lines, self.dash_col) != want:
            self.replace(i, want)
            return
        item.lines = lines
        item.entry = want
        self.touched = True

    def _lines_for(self, entry: Any) -> list[str]:
        text = dump_yaml([entry]).rstrip("\n")
        return [" " * self.dash_col + line + self.eol for line in text.split("\n")]

    def start_of(self, i: int) -> int:
        """Where entry `i` begins, its describing comments included (to insert before it)."""
        lead = self.lead(i)
        return lead[0] if lead else i


def _render(text: str, out: str | None) -> str:
    return f"{STASH}{out} | {text}" if out else text


def load(text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"LiteLLM config is not valid YAML ({first}): fix the file on "
                         "the gateway host or put its backup (<config>.previous) back") from None
    if not isinstance(data, dict):
        raise ValueError("LiteLLM config is not a mapping: fix the file on the gateway host")
    return data


def fresh(config: dict[str, Any], notes: dict[str, str] | None = None) -> Doc:
    """A config that has no text yet (or whose text is replaced): written as a dump."""
    doc = parse(dump_yaml(config))
    doc.notes = dict(notes or {})
    doc.touched = True
    return doc


def _last_line(node: yaml.Node) -> int:
    """The last line holding part of `node` (a block collection's end mark lies past the comments
    after it: only its leaves are exact)."""
    if isinstance(node, yaml.ScalarNode) or getattr(node, "flow_style", False):
        m = node.end_mark
        return m.line - 1 if m.column == 0 and m.line > node.start_mark.line else m.line
    if isinstance(node, yaml.SequenceNode):
        kids = list(node.value)
    else:
        kids = [x for pair in node.value for x in pair]
    return max([node.start_mark.line, *(_last_line(k) for k in kids)])


def _lossy(text: str, why: str) -> Doc:
    doc = fresh(load(text))
    notes, _ = parse_notes(text.split("\n"))
    doc.notes, doc.lossy, doc.original, doc.touched = notes, why, text, False
    return doc


def parse(text: str) -> Doc:
    """The config file's text, cut into lines (see the module docstring). Raises ValueError with
    one line naming what to fix when it is not a YAML mapping or a stash was broken by hand."""
    if re.search("\r(?!\n)|[\x85\u2028\u2029]", text):
        return _lossy(text, "line breaks other than \\n or \\r\\n")
    final_nl = text.endswith("\n")
    raw = text.split("\n")
    if final_nl:
        raw.pop()
    notes, body = parse_notes(raw)
    eol = "\r" if body and body[0].endswith("\r") else ""
    lines = []
    for line in body:
        m = _STASH_RE.match(line)
        lines.append(Line(m.group(2), m.group(1)) if m else Line(line))
    virtual = "\n".join(line.text for line in lines)
    data = load(virtual)  # the file with every stashed entry back: one clear error if it is not YAML
    try:
        root = yaml.compose(virtual, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:  # load() passed: not expected, but never a traceback
        raise ValueError(f"LiteLLM config could not be read line by line ({type(e).__name__})") from None
    base = dict(notes=notes, eol=eol, final_nl=final_nl)
    if root is None:
        return Doc(pre=lines, region=[], post=[], key_missing=True, **base)
    if not isinstance(root, yaml.MappingNode):
        raise ValueError("LiteLLM config is not a mapping: fix the file on the gateway host")
    if root.flow_style:
        return _lossy(text, "the config is one flow-style mapping")
    pair = next(((k, v) for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "model_list"), None)
    if pair is None:
        return Doc(pre=lines, region=[], post=[], key_missing=True, **base)
    key, value = pair
    kl = key.start_mark.line
    if isinstance(value, yaml.ScalarNode) and value.tag == "tag:yaml.org,2002:null" or (
            isinstance(value, yaml.SequenceNode) and value.flow_style and not value.value):
        span = None
        if value.start_mark.line == kl and value.end_mark.index > value.start_mark.index:
            span = (kl, value.start_mark.column, value.end_mark.column)
        return Doc(pre=lines[:kl + 1], region=[], post=lines[kl + 1:], key_value=span, **base)
    if not isinstance(value, yaml.SequenceNode):
        raise ValueError("the LiteLLM config's model_list is not a list: fix the file on the gateway host")
    if value.flow_style:
        return _lossy(text, "model_list is written in flow style ([...])")
    entries = data.get("model_list")
    if not isinstance(entries, list) or len(entries) != len(value.value):
        return _lossy(text, "model_list could not be matched line by line")
    dash_col = value.start_mark.column
    spans: list[tuple[int, int]] = []
    prev = kl
    for node in value.value:
        d = node.start_mark.line
        while d > prev + 1 and not _is_dash(lines[d].text, dash_col):
            d -= 1
        if not _is_dash(lines[d].text, dash_col) or d <= prev:
            return _lossy(text, "an entry of model_list does not start on a line of its own")
        end = _last_line(node)
        spans.append((d, end))
        prev = end
    if _anchored(virtual, spans[0][0], spans[-1][1]):
        return _lossy(text, "an entry of model_list defines a YAML anchor")
    region: list[Line | Item] = [*lines[kl + 1:spans[0][0]]]
    for j, (d, end) in enumerate(spans):
        if j:
            region += lines[spans[j - 1][1] + 1:d]
        outs = {line.out for line in lines[d:end + 1]}
        if len(outs) > 1:
            raise ValueError(f"model_list entry {j + 1} is partly commented out by spark-pipelines (stash lines "
                             f"'{STASH}...' for {sorted(o or 'none' for o in outs)}): make all of its lines "
                             "stash lines of one node, or none, in the file on the gateway host")
        region.append(Item([line.text for line in lines[d:end + 1]], entries[j], outs.pop()))
    return Doc(pre=lines[:kl + 1], region=region, post=lines[spans[-1][1] + 1:], dash_col=dash_col, **base)


def _is_dash(text: str, col: int) -> bool:
    return not text[:col].strip() and text[col:col + 1] == "-"


def _anchored(text: str, first: int, last: int) -> bool:
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if getattr(ev, "anchor", None) and first <= ev.start_mark.line <= last and not isinstance(ev, yaml.AliasEvent):
            return True
    return False


def _dedent(lines: list[str], col: int) -> list[str]:
    return [line[col:] if not line[:col].strip() else line.lstrip() for line in lines]


def _parse_item(lines: list[str], col: int) -> Any:
    try:
        data = yaml.safe_load("\n".join(_dedent(lines, col)))
    except yaml.YAMLError:
        return None
    return data[0] if isinstance(data, list) and len(data) == 1 else None


def _with_key(lines: list[str], col: int, parent: str, key: str, value: str, eol: str) -> list[str] | None:
    try:
        root = yaml.compose("\n".join(_dedent(lines, col)), Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if not isinstance(root, yaml.SequenceNode) or len(root.value) != 1 or not isinstance(root.value[0], yaml.MappingNode):
        return None
    node = next((v for k, v in root.value[0].value if isinstance(k, yaml.ScalarNode) and k.value == parent), None)
    if not isinstance(node, yaml.MappingNode) or node.flow_style or not node.value:
        return None
    indent = node.value[0][0].start_mark.column + col
    at = _last_line(node) + 1
    new = " " * indent + dump_yaml({key: value}).rstrip("\n") + eol
    return [*lines[:at], new, *lines[at:]]
