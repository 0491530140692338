#!/usr/bin/env python3
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
