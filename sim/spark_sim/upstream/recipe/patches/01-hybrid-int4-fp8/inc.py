"""Hybrid INT4+FP8 dispatch (simulated stand-in of the recipe's patched inc.py)."""
HYBRID_FP8 = True
