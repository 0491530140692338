#!/usr/bin/env python3
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

    class nccl:
        @staticmethod
        def version():
            return (2, 30, 4)  # the runbook's image: "NCCL 2.30.4"
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
