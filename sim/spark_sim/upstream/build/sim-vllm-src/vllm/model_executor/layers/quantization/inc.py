"""Stand-in of vllm/model_executor/layers/quantization/inc.py (upstream, unpatched)."""
HYBRID_FP8 = False
