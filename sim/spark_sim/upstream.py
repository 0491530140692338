"""Local stand-ins for the upstream pieces the pipeline drives, for the simulated fleet.

`make_build_repo` (eugr/spark-vllm-docker), `make_recipe_repo` (albond's recipe) and
`make_model_source` (the Intel AutoRound snapshot and the Qwen FP8 repo) lay out files like the
real ones, with the same anchors, flags, file names and log lines, but everything runs offline:
the build repo's Dockerfile builds FROM a local Python base image with `python3`, `sh` and `git`
only, and the recipe's scripts write tiny but real safetensors files with the stdlib.
Repositories are committed with a fixed author and date, so their shas are reproducible.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spark_pipelines.core.dockerfile import NIGHTLY_CU130_INDEX, STABLE_CU130_INDEX

DEFAULT_BASE_IMAGE = "sim-python-base:latest"
INTEL_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
FP8_REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
# The one public report of the snapshot the runbook used (upstream pins no revision).
INTEL_REVISION = "de5e04f218487cb2fb762c6e9aabec784fb40d00"
FP8_REVISION = hashlib.sha1(b"sim:" + FP8_REPO.encode()).hexdigest()
COMMIT_DATE = "2026-04-04T12:00:00+00:00"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "sim upstream",
    "GIT_AUTHOR_EMAIL": "sim@upstream.invalid",
    "GIT_COMMITTER_NAME": "sim upstream",
    "GIT_COMMITTER_EMAIL": "sim@upstream.invalid",
    "GIT_AUTHOR_DATE": COMMIT_DATE,
    "GIT_COMMITTER_DATE": COMMIT_DATE,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}
# The file PR 38325's diff patches, relative to the vLLM source tree.
SWAPAB_TARGET = "csrc/quantization/w8a8/cutlass/c3x/scaled_mm_blockwise_sm120_fp8_dispatch.cuh"
SWAPAB_DIFF = "patches/05-pr38325-swapab/pr38325-swapab-fp8-sm120.diff"
LMHEAD_MARKER = "DGX_SPARK_INT8_LMHEAD_V2"


class UpstreamError(RuntimeError):
    """A stand-in could not be created (git missing, destination not empty, ...)."""


def _git(dest: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_GIT_ENV)
    try:
        done = subprocess.run(
            ["git", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main", *args],
            cwd=dest, env=env, check=True, capture_output=True, text=True,
        )
    except FileNotFoundError:
        raise UpstreamError("git is not installed; install the 'git' Debian package") from None
    except subprocess.CalledProcessError as exc:
        raise UpstreamError(f"git {' '.join(args)} failed in {dest}: {exc.stderr.strip()}") from None
    return done.stdout.strip()


def _write_tree(dest: Path, files: dict[str, str], executable: set[str]) -> None:
    for rel, text in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755 if rel in executable else 0o644)


def _commit_repo(dest: Path, files: dict[str, str], executable: set[str], message: str) -> str:
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UpstreamError(f"{dest}: not empty; give a new directory for the stand-in repository")
    dest.mkdir(parents=True, exist_ok=True)
    _git(dest, "init", "-q")
    _write_tree(dest, files, executable)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", message)
    return _git(dest, "rev-parse", "HEAD")


_ST_LIB = r'''# --- stdlib safetensors (struct + json), so this script runs on a bare python3 ---
import json as _json
import struct as _struct

DTYPE_BYTES = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


def st_read(path):
    """{name: (dtype, shape, raw bytes)} of a safetensors file, in file order."""
    with open(path, "rb") as fh:
        (n,) = _struct.unpack("<Q", fh.read(8))
        header = _json.loads(fh.read(n).decode("utf-8"))
        data = fh.read()
    header.pop("__metadata__", None)
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], list(info["shape"]), data[b:e])
    return out


def st_keys(path):
    with open(path, "rb") as fh:
        (n,) = _struct.unpack("<Q", fh.read(8))
        header = _json.loads(fh.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header


def st_write(path, tensors, metadata=None):
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        count = 1
        for d in shape:
            count *= d
        if len(raw) != count * DTYPE_BYTES[dtype]:
            raise ValueError("%s: %d bytes for shape %s %s" % (name, len(raw), shape, dtype))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = _json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(_struct.pack("<Q", len(text)))
        fh.write(text)
        for raw in blobs:
            fh.write(raw)
# --- end stdlib safetensors ---
'''


# ---------------------------------------------------------------- build repo (spark-vllm-docker)

SWAPAB_ORIGINAL = """\
#pragma once
// Stand-in of vLLM's SM120 blockwise FP8 GEMM dispatch (the file PR 38325 touches).
#include "cutlass/cutlass.h"

using namespace cute;

template <class OutType, int ScaleGranularityM,
          int ScaleGranularityN, int ScaleGranularityK,
          class MmaTileShape, class ClusterShape,
          class EpilogueScheduler, class MainloopScheduler>
struct cutlass_3x_gemm_fp8_blockwise {
  using ElementAB = cutlass::float_e4m3_t;

  using ElementA = ElementAB;
  using ScaleConfig = cutlass::detail::Sm120BlockwiseScaleConfig<
        ScaleGranularityM, ScaleGranularityN, ScaleGranularityK,
        cute::UMMA::Major::MN, cute::UMMA::Major::K>;
};
"""

SWAPAB_PATCHED = """\
#pragma once
// Stand-in of vLLM's SM120 blockwise FP8 GEMM dispatch (the file PR 38325 touches).
#include "cutlass/cutlass.h"

using namespace cute;

template <class OutType, int ScaleGranularityM,
          int ScaleGranularityN, int ScaleGranularityK,
          class MmaTileShape, class ClusterShape,
          class EpilogueScheduler, class MainloopScheduler,
          bool swap_ab_ = false>
struct cutlass_3x_gemm_fp8_blockwise {
  static constexpr bool swap_ab = swap_ab_;
  using ElementAB = cutlass::float_e4m3_t;

  using ElementA = ElementAB;
  using ScaleConfig = conditional_t<swap_ab,
      cutlass::detail::Sm120BlockwiseScaleConfig<
        ScaleGranularityM, ScaleGranularityN, ScaleGranularityK,
        cute::UMMA::Major::K, cute::UMMA::Major::MN>,
      cutlass::detail::Sm120BlockwiseScaleConfig<
        ScaleGranularityM, ScaleGranularityN, ScaleGranularityK,
        cute::UMMA::Major::MN, cute::UMMA::Major::K>>;
};
"""


def swapab_diff() -> str:
    """A real git-style unified diff turning SWAPAB_ORIGINAL into SWAPAB_PATCHED."""
    body = difflib.unified_diff(
        SWAPAB_ORIGINAL.splitlines(keepends=True),
        SWAPAB_PATCHED.splitlines(keepends=True),
        fromfile=f"a/{SWAPAB_TARGET}",
        tofile=f"b/{SWAPAB_TARGET}",
    )
    return f"diff --git a/{SWAPAB_TARGET} b/{SWAPAB_TARGET}\n" + "".join(body)


VLLM_INIT = '''\
"""Stand-in vLLM package of the simulated base image (not a server)."""
__version__ = "0.19.1.dev0+gSIMREF"
'''
VLLM_LOGITS = '''\
"""Stand-in of vllm/model_executor/layers/logits_processor.py."""


class LogitsProcessor:
    def __init__(self, vocab_size, scale=1.0):
        self.vocab_size = vocab_size
        self.scale = scale

    def forward(self, lm_head, hidden_states):
        return lm_head(hidden_states) * self.scale
'''
VLLM_INC = '''\
"""Stand-in of vllm/model_executor/layers/quantization/inc.py (upstream, unpatched)."""
HYBRID_FP8 = False
'''
VLLM_CLI = '''\
#!/usr/bin/env python3
"""`vllm` console script of the simulated base image: versions, and `serve` via the stand-in engine."""
import os
import sys

STANDIN = "/opt/sim/vllm_standin.py"

import vllm

if len(sys.argv) > 1 and sys.argv[1] in ("--version", "-v"):
    print(vllm.__version__)
    sys.exit(0)
if len(sys.argv) > 1 and sys.argv[1] == "serve" and os.path.exists(STANDIN):
    # The GB10 stand-in engine: answers the OpenAI API as vLLM does (see sim/vllm_standin.py).
    os.execv(sys.executable, [sys.executable, STANDIN] + sys.argv[1:])
print("vllm %s (simulated base image): no serving engine in this image" % vllm.__version__,
      file=sys.stderr)
sys.exit(2)
'''

# The package index of the simulated fleet: what `uv pip install` / `pip install` can resolve.
SIM_UV = r'''#!/usr/bin/env python3
"""Offline stand-in of `uv pip install` and `pip install` for the simulated build.

Resolves requirements against a fixed table per index URL and writes a tiny package
(<name>/__init__.py with __version__) into site-packages. Like the real resolver, a later
install may replace torch by a CPU wheel (SIM_TORCH_CPU_SWAP=1, issue #265) unless an
--override file pins torch.
"""
import json
import os
import re
import shutil
import site
import sys

NIGHTLY = "__NIGHTLY__"
STABLE = "__STABLE__"
INDEXES = {
    STABLE: {
        "torch": ["2.11.0+cu130", "2.12.0+cu130"],
        "torchvision": ["0.26.0+cu130", "0.27.0+cu130"],
        "torchaudio": ["2.10.0+cu130", "2.11.0+cu130"],
        "triton": ["3.6.0"],
    },
    # Only today's nightly: dated nightlies roll off (the runbook's issue #15).
    NIGHTLY: {
        "torch": ["2.13.0.dev20260601+cu130"],
        "torchvision": ["0.28.0.dev20260601+cu130"],
        "torchaudio": ["2.11.0.dev20260601+cu130"],
        "triton": ["3.7.0"],
    },
    "pypi": {
        "starlette": ["0.46.2", "1.0.0"],
        "fastapi": ["0.115.12", "0.116.1"],
        "transformers": ["4.57.1", "5.0.0"],
        "torch": ["2.12.0"],
    },
}
SPEC = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$")


def key(version):
    release = version.split("+")[0]
    nums = [int(n) for n in re.findall(r"\d+", release.split(".dev")[0])]
    return (nums, 0 if ".dev" in release else 1, release)


def matches(version, spec):
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.match(r"(==|>=|<=|!=|>|<|~=)?\s*(.*)", clause).groups()
        op = op or "=="
        if op == "==":
            ok = version == want or ("+" not in want and version.split("+")[0] == want)
        elif op == "!=":
            ok = version != want
        else:
            a, b = key(version)[:2], key(want)[:2]
            ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "~=": a >= b}[op]
        if not ok:
            return False
    return True


def site_dir():
    path = site.getsitepackages()[0]
    os.makedirs(path, exist_ok=True)
    return path


def registry_path():
    return os.path.join(site_dir(), "sim-installed.json")


def installed():
    try:
        with open(registry_path()) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


TORCH_CUDA = """
class cuda:
    @staticmethod
    def is_available():
        return os.path.exists("/run/sim-gpu/state.json")

    @staticmethod
    def mem_get_info():
        try:
            with open("/run/sim-gpu/state.json") as fh:
                st = json.load(fh)
        except FileNotFoundError:
            raise RuntimeError("CUDA error: no CUDA-capable device is detected (run with --gpus all)")
        gib = 1024 ** 3
        return int(st["free_gib"] * gib), int(st["total_gib"] * gib)
"""


def record(name, version):
    reg = installed()
    reg[name] = version
    with open(registry_path(), "w") as fh:
        json.dump(reg, fh, indent=1, sort_keys=True)
    module = name.replace("-", "_")
    pkg = os.path.join(site_dir(), module)
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as fh:
        if module == "torch":
            fh.write("import json\nimport os\n")
        fh.write("__version__ = %r\n" % version)
        if module == "torch":
            cuda = version.split("+cu")[1] if "+cu" in version else None
            cuda = cuda and "%s.%s" % (cuda[:-1], cuda[-1])
            fh.write("class version:\n    cuda = %r\n" % cuda)
            if cuda:
                # torch.cuda.mem_get_info() as the preflight's memcheck calls it: the simulated
                # GB10 state that the GPU hook injects into every --gpus container.
                fh.write(TORCH_CUDA)
    print(" + %s==%s" % (name, version))


def resolve(name, spec, index_url):
    table = INDEXES.get(index_url or "pypi")
    if table is None:
        sys.exit("error: index %s is not reachable from the simulated build" % index_url)
    versions = table.get(name)
    if versions is None:
        if index_url:
            sys.exit("error: %s has no package %s" % (index_url, name))
        return "0.1.0"  # any other PyPI name: one placeholder release
    fit = sorted((v for v in versions if matches(v, spec)), key=key)
    if not fit:
        sys.exit(
            "  x No solution found when resolving dependencies:\n"
            "  ╰─▶ Because there is no version of %s%s on %s and you require %s%s, "
            "we can conclude that your requirements are unsatisfiable."
            % (name, spec, index_url or "pypi", name, spec)
        )
    return fit[-1]


def read_overrides(paths):
    out = {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if line and not line.startswith("#"):
                    name, _, spec = SPEC.match(line).groups()
                    out[name.lower()] = spec
    return out


def install(args):
    index_url, overrides, reqs, no_deps = None, [], [], False
    it = iter(args)
    for arg in it:
        if arg in ("--index-url", "-i"):
            index_url = next(it)
        elif arg.startswith("--index-url="):
            index_url = arg.split("=", 1)[1]
        elif arg == "--override":
            overrides.append(next(it))
        elif arg == "--no-deps":
            no_deps = True
        elif arg in ("-r", "--requirement"):
            with open(next(it)) as fh:
                reqs += [l.strip() for l in fh if l.strip() and not l.startswith("#")]
        elif arg.startswith("-"):
            continue  # -U, --pre, -v, --system ...: no effect offline
        else:
            reqs.append(arg)
    pins = read_overrides(overrides)
    wanted = []
    for req in reqs:
        if os.path.isdir(req):  # a built package directory (the simulated vLLM wheel)
            meta = json.load(open(os.path.join(req, "sim-wheel.json")))
            target = os.path.join(site_dir(), meta["name"])
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(req, meta["name"]), target)
            reg = installed()
            reg[meta["name"]] = meta["version"]
            json.dump(reg, open(registry_path(), "w"), indent=1, sort_keys=True)
            print(" + %s==%s (from %s)" % (meta["name"], meta["version"], req))
            if not no_deps:
                wanted += [(r, None) for r in meta.get("requires", [])]
            continue
        wanted.append((req, index_url))
    for req, url in wanted:
        name, _, spec = SPEC.match(req).groups()
        spec = pins.get(name.lower(), spec)
        record(name, resolve(name, spec, url))
    torch_requested = any(SPEC.match(r).group(1) == "torch" for r, _ in wanted)
    if (os.environ.get("SIM_TORCH_CPU_SWAP") == "1" and not torch_requested
            and "torch" in installed() and "torch" not in pins):
        base = installed()["torch"].split("+")[0]
        print("Resolved newer nvidia-* wheels; torch re-resolved to the CPU build", file=sys.stderr)
        record("torch", base + "+cpu")


def main(argv):
    prog = os.path.basename(argv[0])
    args = argv[1:]
    if prog == "uv":
        if args[:2] != ["pip", "install"]:
            sys.exit("sim uv: only `uv pip install` is available offline")
        return install(args[2:])
    if args[:1] != ["install"]:
        sys.exit("sim pip: only `pip install` is available offline")
    return install(args[1:])


if __name__ == "__main__":
    main(sys.argv)
'''.replace("__NIGHTLY__", NIGHTLY_CU130_INDEX).replace("__STABLE__", STABLE_CU130_INDEX)

SIM_BUILD_VLLM = r'''#!/usr/bin/env python3
"""`uv build` stand-in: package the vLLM source tree as a wheel directory, recording the torch
it was compiled against (its ABI) and the patched CUDA sources it would compile."""
import json
import os
import shutil
import subprocess
import sys

import torch

src, out, ref = sys.argv[1], sys.argv[2], sys.argv[3]
pkg = os.path.join(out, "vllm")
shutil.rmtree(out, ignore_errors=True)
shutil.copytree(os.path.join(src, "vllm"), pkg)
shutil.copytree(os.path.join(src, "csrc"), os.path.join(pkg, "_csrc"))
version = "0.19.1.dev0+g%s" % ref[:9]
with open(os.path.join(pkg, "__init__.py"), "w") as fh:
    fh.write('"""Stand-in vLLM package of the simulated base image."""\n')
    fh.write("__version__ = %r\n" % version)
with open(os.path.join(pkg, "_torch_abi.txt"), "w") as fh:
    fh.write(torch.__version__ + "\n")
requires = ["transformers<5"]
with open(os.path.join(out, "sim-wheel.json"), "w") as fh:
    json.dump({"name": "vllm", "version": version, "requires": requires}, fh)
print("Built vllm %s against torch %s" % (version, torch.__version__))
'''

SIM_CHECK_ABI = r'''#!/usr/bin/env python3
"""Import-time check of the simulated vLLM: its _C was built against one torch build."""
import os
import sys

import torch
import vllm

abi = open(os.path.join(os.path.dirname(vllm.__file__), "_torch_abi.txt")).read().strip()
if abi != torch.__version__:
    sys.exit("ImportError: vllm/_C.abi3.so: undefined symbol: "
             "_ZN2at4cuda24getCurrentCUDABlasHandleEv (built with torch %s, image has %s)"
             % (abi, torch.__version__))
print("vllm %s imports with torch %s" % (vllm.__version__, torch.__version__))
'''


def _build_dockerfile() -> str:
    nightly = NIGHTLY_CU130_INDEX
    return f"""\
# Simulated stand-in of eugr/spark-vllm-docker's Dockerfile: same stages and edit anchors,
# builds offline FROM a local Python base image (python3, sh, git).

# Limit build parallelism to reduce OOM situations
ARG BUILD_JOBS=16
ARG SIM_BASE_IMAGE={DEFAULT_BASE_IMAGE}

# =========================================================
# STAGE 1: Base Build Image
# =========================================================
FROM ${{SIM_BASE_IMAGE}} AS base

ARG BUILD_JOBS
ENV MAX_JOBS=${{BUILD_JOBS}}
ENV VLLM_BASE_DIR=/workspace/vllm
ENV PIP_BREAK_SYSTEM_PACKAGES=1

# Offline package tools of the simulated fleet
COPY sim/uv.py /usr/local/bin/uv
COPY sim/uv.py /usr/local/bin/pip
COPY sim/build_vllm.py /opt/sim/build_vllm.py
COPY sim/check_abi.py /opt/sim/check_abi.py
COPY sim/vllm_standin.py /opt/sim/vllm_standin.py
RUN chmod 755 /usr/local/bin/uv /usr/local/bin/pip

# Additional deps
RUN uv pip install torch torchvision torchaudio triton --index-url {nightly} && \\
     uv pip install nvidia-nvshmem-cu13 "apache-tvm-ffi<0.2" filelock

ARG TORCH_CUDA_ARCH_LIST="12.1a"
ENV TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST}}
WORKDIR $VLLM_BASE_DIR

# =========================================================
# STAGE 2: FlashInfer Builder
# =========================================================
FROM base AS flashinfer-builder

RUN uv pip install packaging && \\
    mkdir -p /workspace/wheels && \\
    python3 -c "import torch; open('/workspace/wheels/.flashinfer-torch', 'w').write(torch.__version__)"

# =========================================================
# STAGE 3: FlashInfer Wheel Export
# =========================================================
FROM scratch AS flashinfer-export
COPY --from=flashinfer-builder /workspace/wheels /

# =========================================================
# STAGE 4: vLLM Builder
# =========================================================
FROM base AS vllm-builder

# Git reference (branch, tag, or SHA) to checkout
ARG VLLM_REF=main

# The vLLM source tree (stand-in; upstream clones vllm-project/vllm here)
COPY sim-vllm-src $VLLM_BASE_DIR/vllm

WORKDIR $VLLM_BASE_DIR/vllm

ARG VLLM_PRS=""

RUN if [ -n "$VLLM_PRS" ]; then \\
        echo "Applying PRs: $VLLM_PRS"; \\
        for pr in $VLLM_PRS; do \\
            echo "Recording PR #$pr (no network in the simulated build)"; \\
            echo "$pr" >> /workspace/vllm-prs.txt; \\
        done; \\
    fi

# TEMPORARY PATCH for broken FP8 kernels - https://github.com/vllm-project/vllm/pull/35568
RUN echo "Fetching PR 35568..." \\
    && python3 -c "import sys; sys.exit('pr35568.diff: force-pushed upstream, does not apply to this vLLM ref')" \\
    && rm pr35568.diff

# TEMPORARY PATCH for broken compilation - https://github.com/vllm-project/vllm/pull/38919
RUN echo "Fetching PR 38919..." \\
    && python3 -c "import sys; sys.exit('pr38919.diff: force-pushed upstream, does not apply to this vLLM ref')" \\
    && rm pr38919.diff

# Final Compilation
RUN python3 /opt/sim/build_vllm.py $VLLM_BASE_DIR/vllm /workspace/wheels "$VLLM_REF"

# =========================================================
# STAGE 5: vLLM Wheel Export
# =========================================================
FROM scratch AS vllm-export
COPY --from=vllm-builder /workspace/wheels /

# =========================================================
# STAGE 6: Runner
# =========================================================
FROM ${{SIM_BASE_IMAGE}} AS runner

ENV VLLM_BASE_DIR=/workspace/vllm
ENV PIP_BREAK_SYSTEM_PACKAGES=1
COPY --from=base /usr/local/bin/uv /usr/local/bin/uv
COPY --from=base /usr/local/bin/pip /usr/local/bin/pip
COPY --from=base /opt/sim /opt/sim
COPY sim/vllm-cli.py /usr/local/bin/vllm
RUN chmod 755 /usr/local/bin/vllm

WORKDIR $VLLM_BASE_DIR

ARG PRE_TRANSFORMERS=0
# Simulates issue #265: a later resolve swaps torch for the CPU wheel unless it is overridden.
ARG SIM_TORCH_CPU_SWAP=0

# Install deps
RUN uv pip install torch torchvision torchaudio triton --index-url {nightly} && \\
     uv pip install nvidia-nvshmem-cu13 "apache-tvm-ffi<0.2"

COPY --from=vllm-builder /workspace/wheels /workspace/wheels
# With --tf5: override vLLM's transformers<5 constraint to get transformers>=5
RUN if [ "$PRE_TRANSFORMERS" = "1" ]; then \\
        echo "transformers>=5.0.0" > /tmp/tf-override.txt && \\
        uv pip install /workspace/wheels --override /tmp/tf-override.txt; \\
    else \\
        uv pip install /workspace/wheels; \\
    fi

# Final extra deps
RUN uv pip install ray[default] fastsafetensors

RUN python3 /opt/sim/check_abi.py

# Build metadata (generated by build-and-copy.sh)
COPY build-metadata.yaml /workspace/build-metadata.yaml
"""


BUILD_AND_COPY = r"""#!/usr/bin/env bash
# Simulated stand-in of eugr/spark-vllm-docker's build-and-copy.sh: same flags, builds the
# Dockerfile offline and copies the image to other nodes with docker save | ssh docker load.
set -e

IMAGE_TAG="vllm-node"
VLLM_REF="main"
PRE_TRANSFORMERS=false
BUILD_JOBS="16"
VLLM_PRS=""
COPY_HOSTS=()
NO_BUILD=false
SSH_USER="${SSH_USER:-$USER}"
SIM_BASE_IMAGE="${SIM_BASE_IMAGE:-__BASE__}"
TMP_IMAGE=""

usage() {
    echo "Usage: $0 [-t|--tag TAG] [--vllm-ref REF] [--tf5] [-j|--build-jobs N]"
    echo "          [--apply-vllm-pr PR] [-c|--copy-to host1[,host2...]] [--no-build]"
}

cleanup() {
    if [ -n "$TMP_IMAGE" ] && [ -f "$TMP_IMAGE" ]; then rm -f "$TMP_IMAGE"; fi
    rm -f ./build-metadata.yaml
}
trap cleanup EXIT

while [ $# -gt 0 ]; do
    case "$1" in
        -t|--tag) IMAGE_TAG="$2"; shift 2 ;;
        --vllm-ref) VLLM_REF="$2"; shift 2 ;;
        --tf5|--pre-tf|--pre-transformers) PRE_TRANSFORMERS=true; shift ;;
        -j|--build-jobs) BUILD_JOBS="$2"; shift 2 ;;
        --apply-vllm-pr) VLLM_PRS="${VLLM_PRS:+$VLLM_PRS }$2"; shift 2 ;;
        -c|--copy-to)
            shift
            while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do
                IFS=',' read -ra parts <<< "$1"
                for p in "${parts[@]}"; do [ -n "$p" ] && COPY_HOSTS+=("$p"); done
                shift
            done
            ;;
        --no-build) NO_BUILD=true; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "Unknown option: $1" >&2; usage >&2; exit 1 ;;
    esac
done

case "$BUILD_JOBS" in
    ''|*[!0-9]*) echo "Error: --build-jobs needs a positive integer, got '$BUILD_JOBS'" >&2; exit 1 ;;
esac
if [ -z "$IMAGE_TAG" ]; then echo "Error: --tag needs a value" >&2; exit 1; fi

if [ "$NO_BUILD" = false ]; then
    TF5=$([ "$PRE_TRANSFORMERS" = true ] && echo true || echo false)
    cat > ./build-metadata.yaml <<EOF
build_script_commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)
vllm_version: 0.19.1.dev0+g${VLLM_REF:0:9}
base_image: ${SIM_BASE_IMAGE}
build_args:
  vllm_ref: ${VLLM_REF}
  transformers_5: ${TF5}
  vllm_prs: "${VLLM_PRS}"
  build_jobs: ${BUILD_JOBS}
EOF
    echo "Generated build-metadata.yaml"
    echo "Building image ${IMAGE_TAG} (vLLM ref ${VLLM_REF}, jobs ${BUILD_JOBS})..."
    docker build \
        --build-arg "SIM_BASE_IMAGE=${SIM_BASE_IMAGE}" \
        --build-arg "BUILD_JOBS=${BUILD_JOBS}" \
        --build-arg "VLLM_REF=${VLLM_REF}" \
        --build-arg "VLLM_PRS=${VLLM_PRS}" \
        --build-arg "PRE_TRANSFORMERS=$([ "$PRE_TRANSFORMERS" = true ] && echo 1 || echo 0)" \
        --build-arg "SIM_TORCH_CPU_SWAP=${SIM_TORCH_CPU_SWAP:-0}" \
        -t "${IMAGE_TAG}" .
fi

if [ "${#COPY_HOSTS[@]}" -gt 0 ]; then
    TMP_IMAGE=$(mktemp /tmp/vllm-image.XXXXXX.tar)
    echo "Saving image ${IMAGE_TAG} to ${TMP_IMAGE}..."
    docker save -o "$TMP_IMAGE" "$IMAGE_TAG"
    for host in "${COPY_HOSTS[@]}"; do
        echo "Loading image into ${SSH_USER}@${host}..."
        # SSH_OPTS: extra ssh options (port, key) of the simulated fleet, word-split on purpose
        # shellcheck disable=SC2086
        ssh ${SSH_OPTS:-} "${SSH_USER}@${host}" "docker load" < "$TMP_IMAGE"
    done
fi
echo "Done."
""".replace("__BASE__", DEFAULT_BASE_IMAGE)


def build_repo_files() -> dict[str, str]:
    return {
        "Dockerfile": _build_dockerfile(),
        "build-and-copy.sh": BUILD_AND_COPY,
        "README.md": "Simulated stand-in of eugr/spark-vllm-docker (offline build).\n",
        "sim/uv.py": SIM_UV,
        "sim/build_vllm.py": SIM_BUILD_VLLM,
        "sim/check_abi.py": SIM_CHECK_ABI,
        "sim/vllm-cli.py": VLLM_CLI,
        "sim/vllm_standin.py": (Path(__file__).parent / "vllm_standin.py").read_text(),
        "sim-vllm-src/vllm/__init__.py": VLLM_INIT,
        "sim-vllm-src/vllm/model_executor/__init__.py": "",
        "sim-vllm-src/vllm/model_executor/layers/__init__.py": "",
        "sim-vllm-src/vllm/model_executor/layers/logits_processor.py": VLLM_LOGITS,
        "sim-vllm-src/vllm/model_executor/layers/quantization/__init__.py": "",
        "sim-vllm-src/vllm/model_executor/layers/quantization/inc.py": VLLM_INC,
        f"sim-vllm-src/{SWAPAB_TARGET}": SWAPAB_ORIGINAL,
    }


def make_build_repo(dest: str | Path) -> str:
    """Create the spark-vllm-docker stand-in as a git repository at `dest`; return its sha."""
    files = build_repo_files()
    executable = {"build-and-copy.sh", "sim/uv.py", "sim/build_vllm.py", "sim/check_abi.py",
                  "sim/vllm-cli.py"}
    return _commit_repo(Path(dest), files, executable, "Simulated spark-vllm-docker")


# ---------------------------------------------------------------- recipe repo (albond)

_HUB_LOOKUP = r'''
def hub_snapshot(repo_id):
    """Local snapshot of an HF repo id (offline hub cache, like hf_hub_download's layout)."""
    if os.path.isdir(repo_id):
        return Path(repo_id)
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    root = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / "main"
    if not ref.is_file():
        raise FileNotFoundError("%s is not in the hub cache %s" % (repo_id, cache))
    return root / "snapshots" / ref.read_text().strip()
'''

BUILD_HYBRID = r'''#!/usr/bin/env python3
"""Build a hybrid INT4 + FP8 checkpoint (simulated stand-in of the recipe's script).

Keeps the Intel AutoRound INT4 experts and replaces the BF16 shared-expert dense layers by
the FP8 (E4M3, block-128) tensors of the FP8 repo, adding their `.weight_scale_inv` scales.
Same CLI and log lines as the real script; stdlib only.
"""
import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger("build-hybrid")
__ST_LIB__
__HUB__

def find_model_safetensors_files(directory):
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    if not shards:
        raise FileNotFoundError("No model.safetensors files found in %s" % directory)
    return shards


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description="Build hybrid GPTQ-INT4 + FP8 checkpoint")
    parser.add_argument("--gptq-dir", required=True, help="Path to GPTQ-INT4 model")
    parser.add_argument("--fp8-repo", default="Qwen/Qwen3.5-122B-A10B-FP8", help="HF repo for FP8 model")
    parser.add_argument("--output", required=True, help="Output directory")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--force", action="store_true",
                        help="Allow output cleanup and continue despite many unmatched FP8 tensors")
    args = parser.parse_args()
    gptq_dir, output_dir = Path(args.gptq_dir), Path(args.output)
    if not gptq_dir.is_dir():
        raise FileNotFoundError("GPTQ directory does not exist: %s" % gptq_dir)
    if not (gptq_dir / "config.json").is_file():
        raise FileNotFoundError("Missing config.json in %s" % gptq_dir)
    gptq_shards = find_model_safetensors_files(gptq_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not args.force:
        raise FileExistsError("Output directory %s exists and is not empty. Use --force "
                              "to remove existing model.safetensors* and config.json files before building."
                              % output_dir)
    logger.info("=== Hybrid GPTQ-INT4 + FP8 Checkpoint Builder ===")
    logger.info("  GPTQ source: %s", gptq_dir)
    logger.info("  FP8 source:  %s", args.fp8_repo)
    logger.info("  Output:      %s", output_dir)
    logger.info("")
    logger.info("[1/5] Fetching FP8 tensor manifest...")
    fp8_dir = hub_snapshot(args.fp8_repo)
    with open(fp8_dir / "model.safetensors.index.json") as fh:
        fp8_index = json.load(fh)["weight_map"]
    manifest = {k: v for k, v in fp8_index.items() if ".experts." not in k}
    shards_needed = sorted(set(manifest.values()))
    logger.info("  Non-expert tensors: %d", len(manifest))
    logger.info("  Shards to download: %s", shards_needed)
    if args.dry_run:
        logger.info("")
        logger.info("[DRY RUN] Would download shards and build hybrid. Exiting.")
        return 0
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.force:
        # like upstream: only model.safetensors* and config.json, never the model-*-of-* shards
        for path in sorted(set(output_dir.glob("model.safetensors*")) | set(output_dir.glob("config.json"))):
            if path.is_file():
                path.unlink()
                logger.info("  Deleted %s", path)
    logger.info("")
    logger.info("[2/5] Downloading %d FP8 shards...", len(shards_needed))
    logger.info("")
    logger.info("[3/5] Extracting FP8 tensors...")
    fp8 = {}
    for shard in shards_needed:
        tensors = st_read(fp8_dir / shard)
        wanted = [k for k, v in manifest.items() if v == shard]
        logger.info("  Extracting %d tensors from %s...", len(wanted), shard)
        for k in wanted:
            fp8[k] = tensors[k]
    logger.info("  Extracted: %d tensors", len(fp8))
    logger.info("")
    logger.info("[4/5] Building hybrid checkpoint...")
    # Copies every non-safetensors file first -- Intel's index included; it is rebuilt at [5/5].
    for f in gptq_dir.iterdir():
        if f.suffix != ".safetensors" and not f.name.startswith(".") and f.is_file():
            shutil.copy2(f, output_dir / f.name)
    replaced = added = saved = 0
    placed = set()
    for i, shard in enumerate(gptq_shards):
        logger.info("  [%d/%d] %s...", i + 1, len(gptq_shards), shard.name)
        out = {}
        count = 0
        for name, tensor in st_read(shard).items():
            if name in fp8:
                if list(tensor[1]) != list(fp8[name][1]):
                    raise ValueError("Shape mismatch for %s: GPTQ=%s, FP8=%s" % (name, tensor[1], fp8[name][1]))
                saved += len(tensor[2]) - len(fp8[name][2])
                out[name] = fp8[name]
                placed.add(name)
                count += 1
                scale = name.replace(".weight", ".weight_scale_inv")
                if scale in fp8 and scale != name:
                    out[scale] = fp8[scale]
                    placed.add(scale)
                    added += 1
            else:
                out[name] = tensor
        replaced += count
        st_write(output_dir / shard.name, out, {"format": "pt"})
        logger.info("    replaced=%d, tensors=%d", count, len(out))
    unexpected = sorted(set(fp8) - placed)
    for name in unexpected:
        logger.warning("WARNING: unexpected unmatched FP8 tensor %s", name)
    if len(unexpected) > 5 and not args.force:
        raise RuntimeError("%d FP8 tensors could not be matched to GPTQ tensors. Use --force "
                           "to proceed anyway." % len(unexpected))
    if os.environ.get("SIM_CRASH_BEFORE_INDEX") == "1":
        # fault injection: the process dies after the last shard, before the index rebuild
        logger.error("Killed")
        os._exit(137)
    logger.info("")
    logger.info("[5/5] Updating index and config...")
    weight_map, total = {}, 0
    for shard in find_model_safetensors_files(output_dir):
        for key, info in st_keys(shard).items():
            weight_map[key] = shard.name
            total += info["data_offsets"][1] - info["data_offsets"][0]
    with open(output_dir / "model.safetensors.index.json", "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2, sort_keys=True)
    logger.info("  Index rebuilt: %d tensors, %.2f GB", len(weight_map), total / 1e9)
    with open(output_dir / "config.json", encoding="utf-8") as fh:
        config = json.load(fh)
    config["_hybrid_quant_info"] = {
        "description": "Hybrid GPTQ-INT4 + FP8 checkpoint for single-GPU deployment",
        "moe_experts": "GPTQ INT4 (group_size=128, sym=True, Marlin kernels)",
        "dense_layers": "FP8 E4M3 block-128",
        "source_fp8": args.fp8_repo,
        "converter": "build-hybrid-checkpoint.py",
    }
    with open(output_dir / "config.json", "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    logger.info("")
    logger.info("=== Complete ===")
    logger.info("  Tensors replaced (BF16\u2192FP8):  %d", replaced)
    logger.info("  Scale tensors added:           %d", added)
    logger.info("  Bytes saved:                   %.2f GB", saved / 1e9)
    logger.info("  Output: %s", output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

ADD_MTP = r'''#!/usr/bin/env python3
"""Add MTP speculative decoding weights (simulated stand-in of the recipe's script).

Intel AutoRound INT4 ships MTP weights in model_extra_tensors.safetensors; the hybrid build's
rebuilt index drops them. This copies the file and maps its mtp keys in the target index.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description="Add MTP weights to a checkpoint index")
    parser.add_argument("--source", required=True,
                        help="Path to Intel AutoRound checkpoint (contains model_extra_tensors.safetensors)")
    parser.add_argument("--target", required=True, help="Path to target checkpoint")
    args = parser.parse_args()
    source, target = Path(args.source), Path(args.target)
    mtp_file = source / "model_extra_tensors.safetensors"
    if not mtp_file.exists():
        raise FileNotFoundError("MTP weights not found: %s" % mtp_file)
    with open(source / "model.safetensors.index.json") as fh:
        src_idx = json.load(fh)
    mtp_keys = {k: v for k, v in src_idx["weight_map"].items() if "mtp" in k.lower()}
    print("Found %d MTP tensors in source index" % len(mtp_keys))
    if not mtp_keys:
        print("No MTP tensors found in source index")
        return 1
    target_mtp = target / "model_extra_tensors.safetensors"
    print("Copying %s -> %s" % (mtp_file, target_mtp))
    shutil.copy2(mtp_file, target_mtp)
    print("  Size: %.1f GB" % (target_mtp.stat().st_size / 1e9))
    with open(target / "model.safetensors.index.json") as fh:
        tgt_idx = json.load(fh)
    added = 0
    for key in mtp_keys:
        if tgt_idx["weight_map"].get(key) != "model_extra_tensors.safetensors":
            added += 1
        tgt_idx["weight_map"][key] = "model_extra_tensors.safetensors"
    with open(target / "model.safetensors.index.json", "w") as fh:
        json.dump(tgt_idx, fh, indent=2)
    print("Added %d MTP tensor mappings to index" % added)
    print("Total tensors: %d" % len(tgt_idx["weight_map"]))
    print("Done. MTP speculative decoding is now available.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

PATCH_LMHEAD = r'''#!/usr/bin/env python3
"""INT8 LM head v2 (simulated stand-in): a pure text transform of vLLM's logits_processor.py."""
import os
import sys

import vllm

MARKER = "__MARKER__"
path = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "layers", "logits_processor.py")
text = open(path).read()
if MARKER in text:
    print("already patched: %s" % path)
    sys.exit(0)
anchor = "    def forward(self, lm_head, hidden_states):\n"
if anchor not in text:
    sys.exit("patch_int8_lmhead: anchor not found in %s" % path)
text = text.replace(anchor, anchor + (
    "        # %s: INT8 LM head\n"
    "        import sys as _sys\n"
    "        print('DGX_SPARK_V2: LM Head -> INT8 (simulated)', file=_sys.stderr)\n" % MARKER), 1)
open(path, "w").write(text)
print("patched %s" % path)
'''.replace("__MARKER__", LMHEAD_MARKER)

PATCHED_INC = '''\
"""Hybrid INT4+FP8 dispatch (simulated stand-in of the recipe's patched inc.py)."""
HYBRID_FP8 = True
'''

DOCKERFILE_V2 = r"""# DGX Spark Qwen3.5-122B v2 (simulated stand-in)
#
# Build:
#   docker build --build-arg VLLM_BASE=vllm-sm121:latest -t vllm-qwen35-v2 -f docker/Dockerfile.v2 .
ARG VLLM_BASE=vllm-sm121:latest
FROM ${VLLM_BASE}

# Patch 1: Hybrid INT4+FP8 dispatch for shared expert dense layers
COPY patches/01-hybrid-int4-fp8/inc.py /opt/patches/inc.py
RUN python3 -c "import os, shutil, vllm; shutil.copy('/opt/patches/inc.py', os.path.join(os.path.dirname(vllm.__file__), 'model_executor/layers/quantization/inc.py'))"

# Patch 2: INT8 LM Head v2 - baked into the image at build time
COPY patches/03-int8-lm-head/patch_int8_lmhead.py /opt/patches/patch_int8_lmhead.py
RUN python3 /opt/patches/patch_int8_lmhead.py \
 && python3 -c "import os, sys, vllm; p = os.path.join(os.path.dirname(vllm.__file__), 'model_executor/layers/logits_processor.py'); sys.exit(0 if '__MARKER__' in open(p).read() else 'marker missing in ' + p)"

ENTRYPOINT ["vllm"]
CMD ["serve", "--help"]
""".replace("__MARKER__", LMHEAD_MARKER)

BENCH = r"""#!/bin/bash
# Qwen3.5-122B-A10B benchmark (simulated stand-in) - measures tok/s for different prompt types
# Usage: ./bench_qwen35.sh [label]
# Runs each test 2x and shows both results

LABEL="${1:-test}"
API="${API:-http://localhost:8000/v1/chat/completions}"
MODEL="${MODEL:-qwen}"

bench() {
  python3 - "$API" "$MODEL" "$1" "$2" "${3:-512}" <<'PY'
import json, sys, time, urllib.request
api, model, name, prompt, max_tokens = sys.argv[1:6]
body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": int(max_tokens), "temperature": 0.0}).encode()
req = urllib.request.Request(api, data=body, headers={"Content-Type": "application/json"})
start = time.time()
try:
    with urllib.request.urlopen(req, timeout=600) as resp:
        data = json.load(resp)
except Exception as exc:
    print("  [%s] FAILED — %s" % (name, exc))
    sys.exit(0)
elapsed = time.time() - start
usage = data.get("usage") or {}
done = usage.get("completion_tokens") or 0
if not done:
    print("  [%s] FAILED — no completion tokens" % name)
    sys.exit(0)
print("  [%s] %d tokens in %.2fs = %.1f tok/s (prompt: %s)"
      % (name, done, elapsed, done / elapsed, usage.get("prompt_tokens")))
PY
}

echo "Qwen3.5-122B-A10B Benchmark: $LABEL"
echo "$(date)"
echo ""
for RUN in 1 2; do
  echo "── Run $RUN/2 ──────────────────────────────────────"
  bench "Q&A" "What are the main differences between TCP and UDP? Be concise." 256
  bench "Code" "Write a Python function that implements binary search on a sorted list. Include type hints and docstring." 512
  bench "JSON" "Generate a JSON array of 10 fictional employees with fields: name, age, department, salary, email, skills (array of 3). Output ONLY valid JSON, no explanation." 1024
  bench "Math" "What is 7823 * 4519? Show only the answer." 64
  bench "LongCode" "Write a complete Python implementation of a red-black tree with insert, delete, and search operations. Include comprehensive docstrings." 2048
  echo ""
done
"""

INSTALL_SH = r"""#!/usr/bin/env bash
# install.sh (simulated stand-in) - Steps 0-4 of the recipe, offline.
# Flags: --no-cache --no-pr38325 --launch --no-launch -h|--help
set -euo pipefail
PROJECT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HYBRID_DIR="${HYBRID_DIR:-${HOME}/models/qwen35-122b-hybrid-int4fp8}"
INTEL_DIR="${INTEL_DIR:?set INTEL_DIR to the Intel AutoRound snapshot (no hub download offline)}"
NO_CACHE=0; WITH_PR38325=1; LAUNCH_MODE="prompt"
for arg in "$@"; do
    case "$arg" in
        --no-cache) NO_CACHE=1 ;;
        --no-pr38325) WITH_PR38325=0 ;;
        --launch) LAUNCH_MODE="yes" ;;
        --no-launch) LAUNCH_MODE="no" ;;
        -h|--help) sed -n '2,3p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown flag: $arg (use --help)" >&2; exit 2 ;;
    esac
done
for tool in python3 git docker; do
    command -v "$tool" >/dev/null 2>&1 || { echo "missing: $tool" >&2; exit 1; }
done
if [ -f "${HYBRID_DIR}/model.safetensors.index.json" ] \
    && ls "${HYBRID_DIR}"/model-0000*-of-*.safetensors >/dev/null 2>&1; then
    echo "Step 1 skipped: hybrid checkpoint already exists at ${HYBRID_DIR}"
else
    python3 "${PROJECT_DIR}/patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py" \
        --gptq-dir "${INTEL_DIR}" --fp8-repo Qwen/Qwen3.5-122B-A10B-FP8 \
        --output "${HYBRID_DIR}" --force
fi
if [ -f "${HYBRID_DIR}/model_extra_tensors.safetensors" ] \
    && grep -q '"mtp\.' "${HYBRID_DIR}/model.safetensors.index.json" 2>/dev/null; then
    echo "Step 2 skipped: MTP weights already present"
else
    python3 "${PROJECT_DIR}/patches/02-mtp-speculative/add-mtp-weights.py" \
        --source "${INTEL_DIR}" --target "${HYBRID_DIR}"
fi
if [ "$NO_CACHE" = 1 ]; then docker rmi -f vllm-qwen35-v2:latest vllm-sm121:latest 2>/dev/null || true; fi
echo "Steps 3-4: build the base image with the build repo's build-and-copy.sh (PR 38325: ${WITH_PR38325}),"
echo "then: docker build --build-arg VLLM_BASE=vllm-sm121:latest -t vllm-qwen35-v2 -f docker/Dockerfile.v2 ."
echo "launch mode: ${LAUNCH_MODE}"
"""


def recipe_repo_files() -> dict[str, str]:
    st_lib = _ST_LIB
    hybrid = BUILD_HYBRID.replace("__ST_LIB__", st_lib).replace("__HUB__", _HUB_LOOKUP)
    return {
        "README.md": "Simulated stand-in of albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4.\n",
        "install.sh": INSTALL_SH,
        "bench_qwen35.sh": BENCH,
        "docker/Dockerfile.v2": DOCKERFILE_V2,
        "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py": hybrid,
        "patches/01-hybrid-int4-fp8/inc.py": PATCHED_INC,
        "patches/02-mtp-speculative/add-mtp-weights.py": ADD_MTP,
        "patches/03-int8-lm-head/patch_int8_lmhead.py": PATCH_LMHEAD,
        SWAPAB_DIFF: swapab_diff(),
    }


def make_recipe_repo(dest: str | Path) -> str:
    """Create the recipe stand-in as a git repository at `dest`; return its sha."""
    executable = {"install.sh", "bench_qwen35.sh",
                  "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py",
                  "patches/02-mtp-speculative/add-mtp-weights.py"}
    return _commit_repo(Path(dest), recipe_repo_files(), executable,
                        "Simulated DGX Spark Qwen3.5-122B recipe")


# ---------------------------------------------------------------- model source (HF hub cache)

_ST: dict = {}
exec(compile(_ST_LIB, "<stdlib safetensors>", "exec"), _ST)  # the same writer the scripts use

DENSE = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelSource:
    hub_cache: Path  # give it to the scripts as HF_HUB_CACHE
    intel_snapshot: Path
    intel_revision: str
    fp8_snapshot: Path
    fp8_revision: str
    layers: int
    shards: int
    mtp_tensors: int

    @property
    def expected_scales(self) -> int:
        return self.layers * len(DENSE)


def _fill(name: str, size: int) -> bytes:
    """Deterministic tensor bytes derived from the tensor's name."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _tensor(name: str, dtype: str, shape: list[int]) -> tuple[str, list[int], bytes]:
    count = 1
    for d in shape:
        count *= d
    return (dtype, shape, _fill(name, count * _ST["DTYPE_BYTES"][dtype]))


def _snapshot_dir(hub: Path, repo_id: str, revision: str) -> Path:
    root = hub / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision, encoding="utf-8")
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _write_sharded(snap: Path, shards: list[dict], extra: dict[str, str] | None = None) -> None:
    weight_map: dict[str, str] = dict(extra or {})
    total = 0
    for n, tensors in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        _ST["st_write"](str(snap / name), tensors, {"format": "pt"})
        for key, (_, _, raw) in tensors.items():
            weight_map[key] = name
            total += len(raw)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), "utf-8")


def make_model_source(
    dest: str | Path, *, layers: int = 48, shards: int = 14, mtp_tensors: int = 8,
    unmatched_fp8: int = 8,
) -> ModelSource:
    """Lay out an HF hub cache at `dest` holding tiny stand-ins of the Intel AutoRound INT4
    snapshot (at INTEL_REVISION) and of the Qwen FP8 repo. The hybrid build finds
    `layers` x 3 shared-expert dense layers to replace (the recipe's 144 with 48 layers)."""
    if layers < 1 or shards < 1 or shards > layers or mtp_tensors < 1 or unmatched_fp8 < 0:
        raise ValueError("need layers >= shards >= 1, mtp_tensors >= 1, unmatched_fp8 >= 0")
    hub = Path(dest)
    if hub.exists() and any(hub.iterdir()):
        raise UpstreamError(f"{hub}: not empty; give a new directory for the model source")
    intel = _snapshot_dir(hub, INTEL_REPO, INTEL_REVISION)
    per_shard: list[dict] = [{} for _ in range(shards)]
    for i in range(layers):
        t = per_shard[i * shards // layers]
        pre = f"model.layers.{i}"
        for proj in DENSE:
            t[f"{pre}.mlp.shared_expert.{proj}.weight"] = _tensor(f"{pre}{proj}", "BF16", [4, 4])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            e = f"{pre}.mlp.experts.0.{proj}"
            t[f"{e}.qweight"] = _tensor(e + "q", "I32", [1, 4])
            t[f"{e}.scales"] = _tensor(e + "s", "F16", [1, 4])
            t[f"{e}.qzeros"] = _tensor(e + "z", "I32", [1, 1])
        t[f"{pre}.input_layernorm.weight"] = _tensor(pre + "ln", "BF16", [4])
    per_shard[0]["model.embed_tokens.weight"] = _tensor("embed", "BF16", [8, 4])
    per_shard[-1]["lm_head.weight"] = _tensor("lm_head", "BF16", [8, 4])
    mtp = {f"mtp.layers.0.t{j}.weight": _tensor(f"mtp{j}", "BF16", [4, 4]) for j in range(mtp_tensors)}
    _ST["st_write"](str(intel / "model_extra_tensors.safetensors"), mtp, {"format": "pt"})
    _write_sharded(intel, per_shard, {k: "model_extra_tensors.safetensors" for k in mtp})
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "auto-round", "bits": 4, "group_size": 128,
                                "sym": True, "packing_format": "auto_round:auto_gptq"},
    }
    (intel / "config.json").write_text(json.dumps(config, indent=2), "utf-8")
    (intel / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}', "utf-8")

    fp8 = _snapshot_dir(hub, FP8_REPO, FP8_REVISION)
    dense: dict = {}
    for i in range(layers):
        pre = f"model.layers.{i}.mlp.shared_expert"
        for proj in DENSE:
            dense[f"{pre}.{proj}.weight"] = _tensor(f"fp8{i}{proj}", "F8_E4M3", [4, 4])
            dense[f"{pre}.{proj}.weight_scale_inv"] = _tensor(f"s{i}{proj}", "F32", [1, 1])
    for i in range(unmatched_fp8):  # named differently upstream: the builder warns and skips them
        dense[f"model.language_model.layers.{i}.self_attn.qkv_proj.weight"] = _tensor(
            f"qkv{i}", "F8_E4M3", [4, 4])
    experts = {"model.layers.0.mlp.experts.0.gate_proj.weight": _tensor("fe", "F8_E4M3", [4, 4])}
    _write_sharded(fp8, [dense, experts])
    (fp8 / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}), "utf-8")
    return ModelSource(hub, intel, INTEL_REVISION, fp8, FP8_REVISION, layers, shards, mtp_tensors)
