#!/usr/bin/env bash
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
