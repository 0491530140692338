#!/usr/bin/env bash
# Simulated stand-in of eugr/spark-vllm-docker's build-and-copy.sh: same flags, builds the
# Dockerfile offline and copies the image to other nodes with docker save | ssh docker load.
set -e

IMAGE_TAG="vllm-node"
VLLM_REF="main"
PRE_TRANSFORMERS=false
BUILD_JOBS="16"
VLLM_PRS=""
COPY_HOSTS=()
NO_BUILD=false
SSH_USER="${SSH_USER:-$USER}"
SIM_BASE_IMAGE="${SIM_BASE_IMAGE:-sim-python-base:latest}"
TMP_IMAGE=""

usage() {
    echo "Usage: $0 [-t|--tag TAG] [--vllm-ref REF] [--tf5] [-j|--build-jobs N]"
    echo "          [--apply-vllm-pr PR] [-c|--copy-to host1[,host2...]] [--no-build]"
}

cleanup() {
    if [ -n "$TMP_IMAGE" ] && [ -f "$TMP_IMAGE" ]; then rm -f "$TMP_IMAGE"; fi
    rm -f ./build-metadata.yaml
}
trap cleanup EXIT

while [ $# -gt 0 ]; do
    case "$1" in
        -t|--tag) IMAGE_TAG="$2"; shift 2 ;;
        --vllm-ref) VLLM_REF="$2"; shift 2 ;;
        --tf5|--pre-tf|--pre-transformers) PRE_TRANSFORMERS=true; shift ;;
        -j|--build-jobs) BUILD_JOBS="$2"; shift 2 ;;
        --apply-vllm-pr) VLLM_PRS="${VLLM_PRS:+$VLLM_PRS }$2"; shift 2 ;;
        -c|--copy-to)
            shift
            while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do
                IFS=',' read -ra parts <<< "$1"
                for p in "${parts[@]}"; do [ -n "$p" ] && COPY_HOSTS+=("$p"); done
                shift
            done
            ;;
        --no-build) NO_BUILD=true; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "Unknown option: $1" >&2; usage >&2; exit 1 ;;
    esac
done

case "$BUILD_JOBS" in
    ''|*[!0-9]*) echo "Error: --build-jobs needs a positive integer, got '$BUILD_JOBS'" >&2; exit 1 ;;
esac
if [ -z "$IMAGE_TAG" ]; then echo "Error: --tag needs a value" >&2; exit 1; fi

if [ "$NO_BUILD" = false ]; then
    TF5=$([ "$PRE_TRANSFORMERS" = true ] && echo true || echo false)
    cat > ./build-metadata.yaml <<EOF
build_script_commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)
vllm_version: 0.19.1.dev0+g${VLLM_REF:0:9}
base_image: ${SIM_BASE_IMAGE}
build_args:
  vllm_ref: ${VLLM_REF}
  transformers_5: ${TF5}
  vllm_prs: "${VLLM_PRS}"
  build_jobs: ${BUILD_JOBS}
EOF
    echo "Generated build-metadata.yaml"
    echo "Building image ${IMAGE_TAG} (vLLM ref ${VLLM_REF}, jobs ${BUILD_JOBS})..."
    docker build \
        --build-arg "SIM_BASE_IMAGE=${SIM_BASE_IMAGE}" \
        --build-arg "BUILD_JOBS=${BUILD_JOBS}" \
        --build-arg "VLLM_REF=${VLLM_REF}" \
        --build-arg "VLLM_PRS=${VLLM_PRS}" \
        --build-arg "PRE_TRANSFORMERS=$([ "$PRE_TRANSFORMERS" = true ] && echo 1 || echo 0)" \
        --build-arg "SIM_TORCH_CPU_SWAP=${SIM_TORCH_CPU_SWAP:-0}" \
        -t "${IMAGE_TAG}" .
fi

if [ "${#COPY_HOSTS[@]}" -gt 0 ]; then
    TMP_IMAGE=$(mktemp /tmp/vllm-image.XXXXXX.tar)
    echo "Saving image ${IMAGE_TAG} to ${TMP_IMAGE}..."
    docker save -o "$TMP_IMAGE" "$IMAGE_TAG"
    for host in "${COPY_HOSTS[@]}"; do
        echo "Loading image into ${SSH_USER}@${host}..."
        # SSH_OPTS: extra ssh options (port, key) of the simulated fleet, word-split on purpose
        # shellcheck disable=SC2086
        ssh ${SSH_OPTS:-} "${SSH_USER}@${host}" "docker load" < "$TMP_IMAGE"
    done
fi
echo "Done."
