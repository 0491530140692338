#!/usr/bin/env python3
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
