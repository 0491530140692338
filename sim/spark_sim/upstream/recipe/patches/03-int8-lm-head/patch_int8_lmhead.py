#!/usr/bin/env python3
"""INT8 LM head v2 (simulated stand-in): a pure text transform of vLLM's logits_processor.py."""
import os
import sys

import vllm

MARKER = "DGX_SPARK_INT8_LMHEAD_V2"
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
