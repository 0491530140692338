#!/usr/bin/env python3
"""`uv build` stand-in: package the vLLM source tree as a wheel directory, recording the torch
it was compiled against (its ABI) and the patched CUDA sources it would compile."""
import json
import os
import shutil
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
