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
