#!/usr/bin/env python3
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
# __ST_LIB__: sim/spark_sim/upstream/st_stdlib.py, inlined when `sim up` makes the repo
# __HUB__: sim/spark_sim/upstream/hub_lookup.py, inlined likewise

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
