#!/usr/bin/env bash
# One-shot check of the CUDA kernels on a lent GPU (an H200): build, test, benchmark, report.
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Writes at most 8 files under $OUT: build.log, ptxas.txt, run.log (nvidia-smi, tests, benches,
# sanitizer), bench_<op>.json for the four kernel benches, report.json (summary of everything).
# Every step has its own timeout and the whole run stays under BUDGET = 450 s (the lease allows
# 8 minutes per check); a failing or skipped step is recorded and the next one still runs, so
# report.json is always written.
set -euo pipefail

OUT=${OUT:-$PWD/out}
BUDGET=450
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
ROOT=$PWD
RUN_LOG=$OUT/run.log
STEPS=/tmp/dspark_check_steps.tsv   # step <TAB> status <TAB> seconds
: >"$STEPS"
: >"$RUN_LOG"
export PYTHONUNBUFFERED=1

# run_step NAME MAX_SECONDS LOGFILE CMD...: runs CMD with a timeout that also respects the total
# budget; records ok / failed(rc) / timeout / skipped. Never aborts the script.
run_step() {
  local name=$1 max=$2 log=$3
  shift 3
  local left=$((BUDGET - SECONDS - 20))
  local limit=$((max < left ? max : left))
  if ((limit < 10)); then
    printf '%s\tskipped (budget)\t0\n' "$name" >>"$STEPS"
    echo "== $name: skipped, budget spent" >>"$RUN_LOG"
    return 0
  fi
  echo "== $name (timeout ${limit}s): $*" >>"$log"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  local status=ok
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status="failed($rc)"; fi
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$STEPS"
  echo "== $name: $status after $((SECONDS - t0))s" >>"$RUN_LOG"
  return 0
}

{
  echo "== nvidia-smi"
  nvidia-smi || true
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv || true
  echo "== nvcc"
  nvcc --version || true
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || true
} >>"$RUN_LOG" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader \
  >/tmp/dspark_smi.txt 2>&1 || true

# ---- build (non-editable install, as CI on a GPU host would) ----
run_step build 300 "$OUT/build.log" env DSPARK_CUDA=1 DSPARK_CUDA_ARCHS=90a DSPARK_PTXAS_VERBOSE=1 \
  python3 -m pip install --no-build-isolation --no-deps -v .
grep -E "ptxas info|bytes stack frame|spill" "$OUT/build.log" >"$OUT/ptxas.txt" 2>/dev/null || true
# The tests import dspark_rt from the checkout (pytest puts the repo root first on sys.path):
# give that copy the freshly built extension too.
SO=$(cd /tmp && python3 -c "import dspark_rt._C as m; print(m.__file__)" 2>/dev/null || true)
if [[ -n "$SO" && -f "$SO" && "$(dirname "$SO")" != "$ROOT/dspark_rt" ]]; then
  cp -f "$SO" "$ROOT/dspark_rt/" && echo "== copied $SO into the checkout" >>"$RUN_LOG"
fi

# ---- tests ----
# test_graphs: CUDA graphs per bucket on tiny models (estimated 20-30 s: a few dozen small captures)
run_step tests 230 "$RUN_LOG" python3 -m pytest -m gpu -q tests/test_ops_cuda.py tests/test_graphs.py \
  -k "not sanitizer" -p no:cacheprovider --junitxml=/tmp/dspark_junit_tests.xml

# ---- kernel benchmarks ----
for op in markov_sample rejection_sample prefix_topk verify_attention; do
  if [[ -f bench/bench_$op.py ]]; then
    run_step "bench_$op" 60 "$RUN_LOG" python3 "bench/bench_$op.py" --device cuda --quick --json "$OUT/bench_$op.json"
  else
    printf '%s\tmissing\t0\n' "bench_$op" >>"$STEPS"
  fi
done

# ---- compute-sanitizer (memcheck, racecheck), last: the slowest and least central ----
run_step sanitizer 240 "$RUN_LOG" python3 -m pytest -m gpu -q tests/test_ops_cuda.py -k sanitizer \
  -p no:cacheprovider --junitxml=/tmp/dspark_junit_sanitizer.xml

# ---- report.json ----
python3 - "$OUT" "$STEPS" <<'PY' || echo "report.json: python failed" >>"$RUN_LOG"
import json, os, re, sys, xml.etree.ElementTree as ET
out, steps_file = sys.argv[1], sys.argv[2]
rep = {"steps": [], "tests": {}, "bench": {}, "build": {}}
for line in open(steps_file):
    name, status, secs = line.rstrip("\n").split("\t")
    rep["steps"].append({"step": name, "status": status, "seconds": int(secs)})
for key, path in (("tests", "/tmp/dspark_junit_tests.xml"), ("sanitizer", "/tmp/dspark_junit_sanitizer.xml")):
    if not os.path.exists(path):
        rep["tests"][key] = None
        continue
    cases = ET.parse(path).getroot().iter("testcase")
    summary = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        if c.find("failure") is not None or c.find("error") is not None:
            summary["failed"] += 1
            summary["failures"].append(name)
        elif c.find("skipped") is not None:
            summary["skipped"] += 1
        else:
            summary["passed"] += 1
    rep["tests"][key] = summary
for name in sorted(os.listdir(out)):
    if name.startswith("bench_") and name.endswith(".json"):
        try:
            rep["bench"][name[6:-5]] = json.load(open(os.path.join(out, name)))
        except Exception as e:  # keep going: a broken bench file is a finding, not a crash
            rep["bench"][name[6:-5]] = {"error": repr(e)}
try:
    rep["build"]["gpu"] = open("/tmp/dspark_smi.txt").read().strip()
except OSError:
    pass
try:
    log = open(os.path.join(out, "build.log"), errors="replace").read()
    m = re.search(r"dspark_rt: CUDA kernels (\S+).*", log)
    rep["build"]["cmake"] = m.group(0) if m else None
    rep["build"]["ptxas_spill_lines"] = sorted({l.strip() for l in log.splitlines()
                                                 if "spill" in l and not " 0 bytes spill stores, 0 bytes spill loads" in l})
except OSError:
    pass
try:
    import dspark_rt._C as C  # the installed build
    rep["build"]["info"] = C.build_info()
except Exception as e:
    rep["build"]["info"] = {"error": repr(e)}
json.dump(rep, open(os.path.join(out, "report.json"), "w"), indent=1, default=str)
print(json.dumps({k: rep[k] for k in ("steps", "tests")}, indent=1))
PY
echo "== done in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$RUN_LOG"
