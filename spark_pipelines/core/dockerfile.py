"""The base-image build's Dockerfile edits, as pure text transforms.

The runbook and the recipe's install.sh edit eugr/spark-vllm-docker's Dockerfile with sed before
building. sed silently does nothing (or deletes to end of file) when upstream changes shape, so
every edit here finds its anchor first and raises `DockerfileEditError` when it is missing,
naming the edit, the anchor, and what to check. Each edit is `(text, params) -> text` and is
idempotent: applying it to its own output changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

NIGHTLY_CU130_INDEX = "https://download.pytorch.org/whl/nightly/cu130"
STABLE_CU130_INDEX = "https://download.pytorch.org/whl/cu130"
TORCH_OVERRIDE_FILE = "/etc/uv-torch-override.txt"

TEMPORARY_PATCH_BLOCKS: tuple[tuple[str, str, str], ...] = (
    # (start marker, end marker, PR id that must be gone afterwards)
    ("# TEMPORARY PATCH for broken FP8 kernels", "&& rm pr35568.diff", "pr35568"),
    ("# TEMPORARY PATCH for broken compilation", "&& rm pr38919.diff", "pr38919"),
)
UNPINNED_TORCH_INSTALL = "uv pip install torch torchvision torchaudio triton --index-url "
VLLM_PRS_BLOCK_START = re.compile(r'^RUN if \[ -n "\$VLLM_PRS" \]; then')

_PIN_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")
_PATCH_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_REQUIREMENT = re.compile(r"^[A-Za-z0-9_.-]+[<>=!~,0-9A-Za-z.+*_ -]*$")


class DockerfileEditError(ValueError):
    """An edit's anchor is missing or its postcondition failed; the build must not go on."""

    def __init__(self, edit: str, anchor: str, advice: str) -> None:
        self.edit = edit
        self.anchor = anchor
        self.advice = advice
        super().__init__(f"Dockerfile edit '{edit}': anchor {anchor!r} not satisfied. {advice}")


@dataclass(frozen=True)
class TorchPins:
    """The torch triple both build stages must install (the values: the fleet file's pins.torch)."""

    torch: str
    torchvision: str
    torchaudio: str
    index_url: str
    source_index_url: str = NIGHTLY_CU130_INDEX

    @classmethod
    def of(cls, pins: Any) -> TorchPins:
        """From the fleet's pins.torch (core.fleet.TorchPins)."""
        return cls(torch=pins.torch, torchvision=pins.torchvision, torchaudio=pins.torchaudio, index_url=pins.index_url)

    def __post_init__(self) -> None:
        for name in ("torch", "torchvision", "torchaudio"):
            value = getattr(self, name)
            if not _PIN_VERSION.match(value):
                raise ValueError(
                    f"TorchPins.{name}={value!r} is not a version; give e.g. '2.12.0+cu130'"
                )
        for name in ("index_url", "source_index_url"):
            value = getattr(self, name)
            if not value.startswith("https://") or any(c.isspace() for c in value) or "|" in value:
                raise ValueError(f"TorchPins.{name}={value!r} must be an https URL without spaces")

    @property
    def install_line(self) -> str:
        return (
            f"uv pip install torch=={self.torch} torchvision=={self.torchvision} "
            f"torchaudio=={self.torchaudio} triton --index-url {self.index_url}"
        )


@dataclass(frozen=True)
class LocalPatch:
    """A diff baked into the vLLM source tree, e.g. name 'pr38325' -> local-pr38325.diff."""

    name: str

    def __post_init__(self) -> None:
        if not _PATCH_NAME.match(self.name):
            raise ValueError(
                f"LocalPatch.name={self.name!r}: use lowercase letters, digits, '.', '_' or '-'"
            )

    @property
    def file_name(self) -> str:
        return f"local-{self.name}.diff"

    @property
    def container_path(self) -> str:
        return f"/tmp/{self.file_name}"


@dataclass(frozen=True)
class ServingPins:
    """Runbook fix: Starlette 1.x breaks the vLLM 0.19 router (the values: the fleet's pins.serving)."""

    starlette: str
    fastapi: str

    @classmethod
    def of(cls, pins: Any) -> ServingPins:
        """From the fleet's pins.serving (core.fleet.ServingPins): version specifiers -> requirements."""
        return cls(starlette=f"starlette{pins.starlette}", fastapi=f"fastapi{pins.fastapi}")

    def __post_init__(self) -> None:
        for name in ("starlette", "fastapi"):
            value = getattr(self, name)
            if not value.startswith(name) or not _REQUIREMENT.match(value) or '"' in value:
                raise ValueError(f"ServingPins.{name}={value!r} must be a requirement on {name}")


@dataclass(frozen=True)
class EditRecord:
    edit: str
    changed: bool
    detail: str
    lines: list[int] = field(default_factory=list)  # 1-based lines touched in the input text


# ---------------------------------------------------------------- (a) temporary patch blocks


def strip_temporary_patches(text: str, params: None = None) -> str:
    return _strip_temporary_patches(text)[0]


def _strip_temporary_patches(text: str) -> tuple[str, EditRecord]:
    lines = text.splitlines(keepends=True)
    removed: list[int] = []  # 1-based, in the text as given
    kept: list[str] = []
    i = 0
    while i < len(lines):
        block = next((b for b in TEMPORARY_PATCH_BLOCKS if b[0] in lines[i]), None)
        if block is None:
            kept.append(lines[i])
            i += 1
            continue
        start, end, _ = block
        j = i
        while j < len(lines) and end not in lines[j]:
            j += 1
        if j == len(lines):
            # sed would delete to end of file here; refuse instead.
            raise DockerfileEditError(
                "strip-temporary-patches",
                end,
                f"the block starting '{start}' (line {i + 1}) has no closing '{end}' line; "
                "upstream changed its shape: read the Dockerfile at the pinned commit and "
                "update TEMPORARY_PATCH_BLOCKS.",
            )
        removed.extend(range(i + 1, j + 2))
        i = j + 1
    lines = kept
    out = "".join(lines)
    for _, _, pr in TEMPORARY_PATCH_BLOCKS:
        if pr in out:
            line_no = next(n for n, line in enumerate(out.splitlines(), 1) if pr in line)
            raise DockerfileEditError(
                "strip-temporary-patches",
                pr,
                f"'{pr}' still appears (line {line_no} of the edited text) after removing the "
                "TEMPORARY PATCH blocks: upstream Dockerfile changed shape; check the pinned "
                "commit of the build repo.",
            )
    detail = f"removed {len(removed)} lines" if removed else "no TEMPORARY PATCH blocks present"
    return out, EditRecord("strip-temporary-patches", bool(removed), detail, removed)


# ---------------------------------------------------------------- (b) torch pin


def pin_torch(text: str, pins: TorchPins) -> str:
    return _pin_torch(text, pins)[0]


def _pin_torch(text: str, pins: TorchPins) -> tuple[str, EditRecord]:
    unpinned = UNPINNED_TORCH_INSTALL + pins.source_index_url
    lines = text.splitlines(keepends=True)
    changed: list[int] = []
    for n, line in enumerate(lines):
        if unpinned in line:
            lines[n] = line.replace(unpinned, pins.install_line)
            changed.append(n + 1)
    out = "".join(lines)
    pinned = sum(1 for line in out.splitlines() if pins.install_line in line)
    if pinned < 2:
        raise DockerfileEditError(
            "pin-torch",
            unpinned,
            f"found {pinned} pinned torch install line(s) after the edit ({len(changed)} changed), "
            "need one per stage (2): the builder and runner stages must install the same torch "
            "or vLLM's _C.so and libtorch_cuda.so disagree (undefined symbol at startup). Check "
            "the index URL of the upstream install lines (TorchPins.source_index_url).",
        )
    leftover = [n for n, line in enumerate(out.splitlines(), 1) if UNPINNED_TORCH_INSTALL in line]
    if leftover:
        raise DockerfileEditError(
            "pin-torch",
            UNPINNED_TORCH_INSTALL.strip(),
            f"an unpinned torch install remains at line(s) {leftover} (another index URL?); "
            "refusing to build an image whose stages may pull different torch builds.",
        )
    detail = (
        f"pinned torch=={pins.torch} on {pins.index_url} in {len(changed)} line(s)"
        if changed
        else f"torch already pinned to {pins.torch} in {pinned} line(s)"
    )
    return out, EditRecord("pin-torch", bool(changed), detail, changed)


# ---------------------------------------------------------------- (e) torch override guard


def _instruction_end(lines: list[str], start: int) -> int:
    """Index of the last physical line of the instruction that begins at `start`."""
    j = start
    while j < len(lines) - 1 and lines[j].rstrip("\n").rstrip().endswith("\\"):
        j += 1
    return j


def _instruction_start(lines: list[str], index: int) -> int:
    j = index
    while j > 0 and lines[j - 1].rstrip("\n").rstrip().endswith("\\"):
        j -= 1
    return j


_FROM = re.compile(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE)
_UV_INSTALL = re.compile(r"\buv pip install\b")


class _GuardedStages:
    """Which build stages install with the torch override: a stage is guarded once its pinned
    install has run, and a stage built FROM a guarded stage inherits the override file."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._current: str | None = None
        self.active = False

    def enter(self, from_match: re.Match[str]) -> None:
        self._current = from_match.group(2)
        self.active = from_match.group(1) in self._names
        self._remember()

    def guard(self) -> None:
        self.active = True
        self._remember()

    def _remember(self) -> None:
        if self.active and self._current:
            self._names.add(self._current)


def _check_torch_guard(text: str, guard_run: str, override_flag: str) -> None:
    """Postcondition: no uv install after the guard runs without the override (install.sh
    likewise refuses an unprotected wheel install)."""
    stages = _GuardedStages()
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        m = _FROM.match(line)
        if m:
            stages.enter(m)
            continue
        if line == guard_run:
            stages.guard()
            continue
        if stages.active and _UV_INSTALL.search(line) and override_flag not in line:
            raise DockerfileEditError(
                "guard-torch-override",
                override_flag,
                f"line {n} installs with uv after the torch pin without the override: "
                f"{line.strip()!r}",
            )


def guard_torch_override(text: str, pins: TorchPins) -> str:
    return _guard_torch_override(text, pins)[0]


def _guard_torch_override(text: str, pins: TorchPins) -> tuple[str, EditRecord]:
    """After each pinned torch install, record the installed torch in an override file and make
    every later `uv pip install` of that stage (and of stages built FROM it) pass
    `--override` with it, so the resolver can never swap torch for the CPU wheel (issue #265)."""
    guard_run = (
        "RUN python3 -c \"import torch; print('torch==' + torch.__version__)\" > "
        f"{TORCH_OVERRIDE_FILE}\n"
    )
    override_flag = f"uv pip install --override {TORCH_OVERRIDE_FILE}"
    lines = text.splitlines(keepends=True)
    if not any(pins.install_line in line for line in lines):
        raise DockerfileEditError(
            "guard-torch-override",
            pins.install_line,
            "no pinned torch install line to guard: apply the pin-torch edit first.",
        )
    out: list[str] = []
    touched: list[int] = []
    stages = _GuardedStages()
    pending_guard_at = -1  # insert the guard RUN after this input line index
    for n, line in enumerate(lines):
        m = _FROM.match(line)
        if m:
            stages.enter(m)
            out.append(line)
            continue
        if pins.install_line in line:
            pending_guard_at = _instruction_end(lines, _instruction_start(lines, n))
            out.append(line)
        elif stages.active and _UV_INSTALL.search(line) and override_flag not in line:
            out.append(_UV_INSTALL.sub(override_flag, line))
            touched.append(n + 1)
        else:
            out.append(line)
        if n == pending_guard_at:
            pending_guard_at = -1
            following = lines[n + 1] if n + 1 < len(lines) else ""
            if following != guard_run:
                if not out[-1].endswith("\n"):
                    out[-1] += "\n"
                out.append(guard_run)
                touched.append(n + 1)
            stages.guard()
    result = "".join(out)
    _check_torch_guard(result, guard_run, override_flag)
    detail = f"override guard on {len(touched)} line(s)" if touched else "override guard present"
    return result, EditRecord("guard-torch-override", bool(touched), detail, touched)


# ---------------------------------------------------------------- (c) local patch injection


def find_vllm_prs_block(text: str) -> tuple[int, int]:
    """0-based (first, last) line of the `RUN if [ -n "$VLLM_PRS" ]; then ... fi` instruction."""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if VLLM_PRS_BLOCK_START.match(line):
            end = _instruction_end([l + "\n" for l in lines], n)
            if lines[end].strip() != "fi" or end == n:
                raise DockerfileEditError(
                    "inject-local-patch",
                    'RUN if [ -n "$VLLM_PRS" ]; then ... fi',
                    f"the VLLM_PRS block at line {n + 1} does not end with a 'fi' line "
                    f"(ends with {lines[end].strip()!r}); upstream changed its shape.",
                )
            return n, end
    raise DockerfileEditError(
        "inject-local-patch",
        'RUN if [ -n "$VLLM_PRS" ]; then',
        "no VLLM_PRS block in the Dockerfile: the local patch has no place in the vLLM "
        "source stage; check the build repo's pinned commit.",
    )


def inject_local_patch(text: str, patch: LocalPatch) -> str:
    return _inject_local_patch(text, patch)[0]


def _inject_local_patch(text: str, patch: LocalPatch) -> tuple[str, EditRecord]:
    copy_line = f"COPY {patch.file_name} {patch.container_path}\n"
    run_line = f"RUN git apply -v {patch.container_path} && rm {patch.container_path}\n"
    first, last = find_vllm_prs_block(text)
    if copy_line in text.splitlines(keepends=True):
        return text, EditRecord(f"inject-{patch.name}", False, "already injected", [])
    lines = text.splitlines(keepends=True)
    if not lines[last].endswith("\n"):
        lines[last] += "\n"
    lines[last + 1 : last + 1] = ["\n", copy_line, run_line]
    detail = f"injected {patch.file_name} after the VLLM_PRS block (lines {first + 1}-{last + 1})"
    return "".join(lines), EditRecord(f"inject-{patch.name}", True, detail, [last + 1])


# ---------------------------------------------------------------- (d) serving image pins


def pin_serving_deps(text: str, pins: ServingPins) -> str:
    return _pin_serving_deps(text, pins)[0]


def _pin_serving_deps(text: str, pins: ServingPins) -> tuple[str, EditRecord]:
    run_line = f'RUN pip install --no-deps "{pins.starlette}" "{pins.fastapi}"\n'
    lines = text.splitlines(keepends=True)
    if run_line in lines:
        return text, EditRecord("pin-serving-deps", False, "already pinned", [])
    entry = next((n for n, line in enumerate(lines) if line.startswith("ENTRYPOINT")), None)
    if entry is None:
        raise DockerfileEditError(
            "pin-serving-deps",
            "ENTRYPOINT",
            "docker/Dockerfile.v2 has no ENTRYPOINT line to insert the starlette/fastapi pin "
            "before; check the recipe repo's commit.",
        )
    comment = "# Fix: Starlette 1.x breaks vLLM 0.19 router\n"
    lines[entry:entry] = [comment, run_line]
    return "".join(lines), EditRecord("pin-serving-deps", True, run_line.strip(), [entry + 1])


# ---------------------------------------------------------------- all base-image edits


def apply_build_edits(
    base_dockerfile: str, torch_pins: TorchPins, patches: list[LocalPatch] | tuple[LocalPatch, ...]
) -> tuple[str, list[EditRecord]]:
    """The base-image Dockerfile edits in runbook order: strip, pin, guard, inject patches."""
    records: list[EditRecord] = []
    text, rec = _strip_temporary_patches(base_dockerfile)
    records.append(rec)
    text, rec = _pin_torch(text, torch_pins)
    records.append(rec)
    text, rec = _guard_torch_override(text, torch_pins)
    records.append(rec)
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise ValueError(f"patches: duplicate names in {names}")
    # Inject in reverse so the first patch ends up right after the block and applies first.
    for patch in reversed(list(patches)):
        text, rec = _inject_local_patch(text, patch)
        records.append(rec)
    return text, records
