#!/bin/bash
# Qwen3.5-122B-A10B benchmark (simulated stand-in) - measures tok/s for different prompt types
# Usage: ./bench_qwen35.sh [label]
# Runs each test 2x and shows both results

LABEL="${1:-test}"
API="${API:-http://localhost:8000/v1/chat/completions}"
MODEL="${MODEL:-qwen}"

bench() {
  python3 - "$API" "$MODEL" "$1" "$2" "${3:-512}" <<'PY'
import json, sys, time, urllib.request
api, model, name, prompt, max_tokens = sys.argv[1:6]
body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": int(max_tokens), "temperature": 0.0}).encode()
req = urllib.request.Request(api, data=body, headers={"Content-Type": "application/json"})
start = time.time()
try:
    with urllib.request.urlopen(req, timeout=600) as resp:
        data = json.load(resp)
except Exception as exc:
    print("  [%s] FAILED — %s" % (name, exc))
    sys.exit(0)
elapsed = time.time() - start
usage = data.get("usage") or {}
done = usage.get("completion_tokens") or 0
if not done:
    print("  [%s] FAILED — no completion tokens" % name)
    sys.exit(0)
print("  [%s] %d tokens in %.2fs = %.1f tok/s (prompt: %s)"
      % (name, done, elapsed, done / elapsed, usage.get("prompt_tokens")))
PY
}

echo "Qwen3.5-122B-A10B Benchmark: $LABEL"
echo "$(date)"
echo ""
for RUN in 1 2; do
  echo "── Run $RUN/2 ──────────────────────────────────────"
  bench "Q&A" "What are the main differences between TCP and UDP? Be concise." 256
  bench "Code" "Write a Python function that implements binary search on a sorted list. Include type hints and docstring." 512
  bench "JSON" "Generate a JSON array of 10 fictional employees with fields: name, age, department, salary, email, skills (array of 3). Output ONLY valid JSON, no explanation." 1024
  bench "Math" "What is 7823 * 4519? Show only the answer." 64
  bench "LongCode" "Write a complete Python implementation of a red-black tree with insert, delete, and search operations. Include comprehensive docstrings." 2048
  echo ""
done
