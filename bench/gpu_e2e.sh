#!/usr/bin/env bash
# End-to-end check on a lent GPU, run after bench/gpu_check.sh on the same warm machine (it
# reuses that build; builds itself when none is there):
#
#   OUT=/some/dir bash bench/gpu_e2e.sh
#
# 1. the CUDA-graph and engine tests on the GPU (graph replay equals eager; greedy equality);
# 2. bench/bench_e2e.py at Qwen3-8B shapes: random bf16 weights and BENCHMARK-ONLY synthetic
#    acceptance (every draft position accepted with probability 0.8, tau 4.16 at full length),
#    ar / dflash / dspark fixed / sync / async at batch 1, 8, 32, 128.
# Writes e2e.log, e2e.json, e2e.png, tests_e2e.log under $OUT; stays under 7 minutes.
set -uo pipefail

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

if ! python3 -c "import sys, dspark_rt._C as m; sys.exit(0 if m.build_info()['cuda'] else 1)" 2>/dev/null; then
  timeout 300 env DSPARK_CUDA=1 DSPARK_CUDA_ARCHS=90a python3 -m pip install --no-build-isolation \
    --no-deps . >"$OUT/build_e2e.log" 2>&1 || echo "build failed (see build_e2e.log)"
  SO=$(cd /tmp && python3 -c "import dspark_rt._C as m; print(m.__file__)" 2>/dev/null || true)
  [[ -n "$SO" && -f "$SO" && "$(dirname "$SO")" != "$PWD/dspark_rt" ]] && cp -f "$SO" dspark_rt/
fi

timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_greedy_equality.py \
  >"$OUT/tests_e2e.log" 2>&1 || echo "gpu graph tests: rc $?" | tee -a "$OUT/tests_e2e.log"

timeout 300 python3 bench/bench_e2e.py --device cuda --model qwen3-8b --accept-prob 0.8 \
  --batch 1 8 32 128 --max-tokens 32 --prompt-len 512 --profile-seconds 8 \
  --json "$OUT/e2e.json" --plot "$OUT/e2e.png" 2>&1 | tee "$OUT/e2e.log"
echo "== done in ${SECONDS}s"
