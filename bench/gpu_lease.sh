#!/usr/bin/env bash
# Everything a lent GPU is for, in ONE call of at most 9 minutes on a fresh machine: pre-flight,
# in-place build for this device's architecture, the CUDA tests of the newest kernel paths and
# compute-sanitizer on their atomic tickets (early and cheap), the other GPU tests, every kernel
# benchmark at its goal shapes (verify_attention first), a trimmed end-to-end run, and
# compute-sanitizer on every op (torch-free driver). One archive comes back. The summary's FIRST
# line says whether the CUDA kernels ran.
#
#   OUT=/some/dir bash bench/gpu_lease.sh [--dry-run] [--skip STEP,...] [--budget SECONDS] [--flex]
#
#   --dry-run  CPU mode (also chosen when torch sees no GPU): the pre-flight reports what is
#              missing without stopping, the build is CPU-only (DSPARK_CUDA=0), the GPU tests
#              are only collected, the kernel driver runs --device cpu --quick, the end-to-end
#              run uses the shipped pair for 4 tokens, the sanitizer driver runs on the CPU
#              kernels (no compute-sanitizer); the archive is written.
#   --skip     steps to leave out: build tests_first tests_ops tests_graphs kernels e2e sanitizer
#              (sanitizer: both sanitizer passes; the pre-flight always runs: it picks the mode
#              and the architecture). A rerun on the
#              still-warm machine skips build (its in-place .so is still there): the summary
#              ends with that command, ready to paste.
#   --budget   seconds of command time for the whole script (default 540)
#   --flex     also time FlexAttention (compiled, R=32 ctx 4k: tens of seconds) in kernels
#   DSPARK_LEASE_FAIL_BUILD=1  the build step fails without building (tests this script's stop)
#
# Fails fast: a failed or timed-out build skips every later step ("skipped (build failed)");
# a GPU-mode test step whose cases all skipped (no CUDA _C) is "failed (all skipped)";
# bench_kernels.py and bench_e2e.py exit non-zero on a GPU without a CUDA build. Exit status 1
# when a step failed, timed out or was skipped for a failed pre-flight / build / spent budget,
# or (GPU mode) when no step ran a CUDA kernel; else 0.
#
# Writes $OUT/gpu_lease.tar.gz (gpu_lease/: steps.tsv, preflight.{log,json}, build.log,
# ptxas.txt, tests_*.{log,xml}, kernels.{log,json}, e2e.{log,json,png}, sanitizer*.log,
# summary.{json,txt}), rewritten after every step so a cut-off run still returns what it did,
# plus $OUT/summary.json and $OUT/summary.txt; prints the summary (one screen) at the end.
# Test seed: DSPARK_TEST_SEED (default 1701), printed and recorded.
#
# Time budget (command time; the lease gives 15 min of device time per session, machine start of
# 2-4 min included, 10 min per command, 8 files back). Expected seconds are estimates for a
# fresh H200 machine (no GPU has run these yet: replace them with the first measured run);
# caps are each step's timeout, cut to what the budget has left. Caps up to kernels sum to
# 30+100+40+20+2x25+110+50+100 = 500 s, + 15 s reserved for the summary = 515 s, so every step
# up to kernels gets its full cap within 540 s even if each one hits it; e2e gets what is left
# (>= 25 s then) up to its cap, the sanitizer on every op the rest (a step cut for budget is
# "skipped (budget spent)" and goes into the printed rerun). Expected total ~410 s: with a 2-4
# min start and the transfers ~11 of 15 lease minutes, leaving a rerun of one failed step on the
# warm machine (printed at the end; start it within ~30 s).
#
#   step               expected cap  why
#   preflight             10     30  python + torch import, NVML, nvcc --version, cmake/ninja on PATH
#   build                 45    100  cmake configure + 6 .cu (markov_sample.cu alone: 15-18 s of
#                                    one loaded core for sm_90a here) in parallel on 16 cores, one arch
#   tests_first           25     40  pytest -m gpu: test_ops_cuda.py's fused split merge, its
#                                    tickets, plan splits, the rejection residual, CuPy arrays;
#                                    test_ops_outputs.py and test_nonfinite_drafts.py (cuda
#                                    variants): ~100 cases, small shapes
#   sanitizer_probe        8     20  nvcc + a 1-kernel program under compute-sanitizer
#   sanitizer_tickets     20  2x25  bench/sanitize_ops.py --cases tickets (no torch: cupy
#                                    buffers): the split-KV merge and the residual merge, where
#                                    blocks meet through an atomic ticket, under memcheck and
#                                    racecheck (cap 25 each)
#   tests_ops             80    110  pytest -m gpu tests/ops/test_ops_cuda.py, the rest (not the
#                                    sanitizer): ~490 cases, a few at 32k context / 32k vocabulary
#   tests_graphs          30     50  pytest -m gpu tests/runner/test_graphs.py tests/e2e/test_lossless.py
#   kernels               60    100  bench/bench_kernels.py: verify_attention first, then markov,
#                                    rejection, prefix_topk; 26 goal shapes, one process; the eager
#                                    reference (3-4 s a shape) at each op's smallest shape only;
#                                    no FlexAttention unless --flex (+~40 s); JSON per row
#   e2e                   70     80  bench_e2e.py qwen3-8b, accept 0.8, batch 1 32, 16 tokens,
#                                    ar / dspark fixed / dspark async (JSON kept per row)
#   sanitizer             50    120  bench/sanitize_ops.py, every op at small shapes, under
#                                    memcheck (cap 60) and racecheck (cap 60)
#   summary                5     15  reserved
#   total               ~410    540  60 s under the 10-minute command limit (call with timeout_s 600)
set -uo pipefail

BUDGET=540
RESERVE=15
DRY=0
SKIP=","
FLEX=none
ARGS=()  # what a rerun repeats (--budget, --flex, --dry-run)
while (($#)); do
  case $1 in
    --dry-run) DRY=1; ARGS+=(--dry-run) ;;
    --skip) SKIP=",$2,"; shift ;;
    --skip=*) SKIP=",${1#--skip=},"; ;;
    --budget) BUDGET=$2; ARGS+=(--budget "$2"); shift ;;
    --budget=*) BUDGET=${1#--budget=}; ARGS+=(--budget "$BUDGET") ;;
    --flex) FLEX=one; ARGS+=(--flex) ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_lease.sh: unknown argument $1 (see --help)" >&2; exit 64 ;;
  esac
  shift
done
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "gpu_lease.sh: --budget must be whole seconds" >&2; exit 64; }

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d)/gpu_lease
mkdir -p "$WORK"
STEPS=$WORK/steps.tsv   # step <TAB> status <TAB> seconds <TAB> limit
: >"$STEPS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export DSPARK_TEST_SEED=${DSPARK_TEST_SEED:-1701}
T0=$SECONDS

archive() {
  tar czf "$OUT/gpu_lease.tar.gz.part" -C "$(dirname "$WORK")" gpu_lease 2>/dev/null &&
    mv -f "$OUT/gpu_lease.tar.gz.part" "$OUT/gpu_lease.tar.gz"
}

record() {  # NAME STATUS SECONDS LIMIT
  printf '%s\t%s\t%s\t%s\n' "$1" "${2//$'\t'/ }" "$3" "$4" >>"$STEPS"
  printf '== %-13s %-28s %4ss (limit %ss, %ss of %ss used)\n' "$1" "$2" "$3" "$4" "$((SECONDS - T0))" "$BUDGET"
}

# run_step NAME CAP CMD...: CMD under a timeout of min(CAP, budget left - RESERVE), output to
# $WORK/NAME.log; records ok / failed(rc) / failed (all skipped) / timeout / skipped. With
# JUNIT=path set (GPU-mode tests), a run that passed no case is "failed (all skipped)".
run_step() {
  local name=$1 cap=$2
  shift 2
  if [[ $SKIP == *",$name,"* ]]; then record "$name" "skipped (--skip)" 0 0; return 0; fi
  local left=$((BUDGET - (SECONDS - T0) - RESERVE))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then record "$name" "skipped (budget spent)" 0 0; return 0; fi
  echo "== $name (timeout ${limit}s): $*" >>"$WORK/$name.log"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" >>"$WORK/$name.log" 2>&1 || rc=$?
  local status=ok
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status="failed($rc)"; fi
  if [[ $status == ok && -n ${JUNIT:-} ]] && ! "$PY" bench/lease_junit.py "$JUNIT" >>"$WORK/$name.log" 2>&1; then
    status="failed (all skipped)"
    echo "gpu_lease: no test case ran (all skipped or none collected): counted as a failure" >>"$WORK/$name.log"
  fi
  record "$name" "$status" "$((SECONDS - t0))" "$limit"
  archive
  return 0
}

skip_step() { record "$1" "skipped ($2)" 0 0; }

# ---- pre-flight: what the later steps need, named when missing ------------------------------
# nvcc and compute-sanitizer are often installed but off PATH: look where CUDA puts them.
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin /usr/local/cuda/compute-sanitizer /opt/nvidia/compute-sanitizer; do
  [[ -d $d ]] || continue
  for tool in nvcc compute-sanitizer; do
    if ! command -v $tool >/dev/null 2>&1 && [[ -x $d/$tool ]]; then
      export PATH=$PATH:$d
      echo "pre-flight: $tool was not on PATH, added $d" >>"$WORK/preflight.log"
    fi
  done
done
cat >"$WORK/preflight.py" <<'PY'
import json, os, shlex, shutil, subprocess, sys, sysconfig
work, dry = sys.argv[1], sys.argv[2] == "1"
rep, missing, notes = {}, [], []
nvcc = shutil.which("nvcc")
rep["nvcc"] = nvcc
if nvcc:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    rep["nvcc_version"] = next((l.strip() for l in out.splitlines() if "release" in l), out.strip()[-80:])
inc = sysconfig.get_paths()["include"]
rep["python"] = sys.version.split()[0]
rep["python_h"] = os.path.exists(os.path.join(inc, "Python.h")) and os.path.join(inc, "Python.h")
for mod in ("pybind11", "pytest", "cupy"):
    try:
        __import__(mod)
        rep[mod] = True
    except ImportError:
        rep[mod] = False
        (notes if mod == "cupy" else missing).append(
            f"python module {mod}" + (" (the sanitizer driver's buffers: sanitizer steps fail)" if mod == "cupy" else ""))
# setup.py runs `cmake` as a program (a pip `cmake` module puts one on PATH, or not)
for tool in ("cmake", "ninja"):
    rep[tool] = shutil.which(tool)
if not rep["cmake"]:
    missing.append("cmake (not on PATH)")
try:  # setup.py asks cmake for Ninja when this imports: the program must then be on PATH
    import ninja  # noqa: F401
    ninja_module = True
except ImportError:
    ninja_module = False
if not rep["ninja"]:
    (missing if ninja_module else notes).append(
        "ninja not on PATH" + (" (the python module is there, so setup.py asks cmake for Ninja)"
                               if ninja_module else " (the build falls back to make)"))
try:
    import torch
    rep["torch"], rep["torch_cuda"] = torch.__version__, torch.version.cuda
    rep["cuda_available"] = torch.cuda.is_available()
    if rep["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability(0)
        rep.update(gpu=p.name, capability=f"{major}.{minor}",
                   l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
                   memory_gib=round(p.total_memory / 2**30, 1),
                   # 'a' (arch-specific: wgmma, setmaxnreg...) from Hopper on, as CMakeLists' 90a
                   arch=f"{major}{minor}{'a' if major >= 9 else ''}")
        if not rep["l2_mib"]:
            notes.append("L2 size unknown (flush buffer falls back to 256 MiB)")
except Exception as e:
    rep["torch"] = f"import failed: {e}"
    rep["cuda_available"] = False
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    rep["nvml"] = {"driver": pynvml.nvmlSystemGetDriverVersion(),
                   "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                   "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000}
    pynvml.nvmlShutdown()
except Exception as e:
    rep["nvml"] = f"unreadable ({type(e).__name__}: {e})"
    notes.append("NVML (clocks / power in the bench headers)")
rep["compute_sanitizer"] = shutil.which("compute-sanitizer")
if not rep["compute_sanitizer"]:
    notes.append("compute-sanitizer (sanitizer step skipped)")
if not nvcc:
    missing.append("nvcc (not on PATH nor in /usr/local/cuda*/bin)")
if not rep["python_h"]:
    missing.append(f"Python.h (not in {inc}: the python3-dev headers)")
if not rep["cuda_available"]:
    missing.append("a CUDA device visible to torch (torch.cuda.is_available() is False)")
rep["missing"], rep["optional_missing"] = missing, notes
json.dump(rep, open(os.path.join(work, "preflight.json"), "w"), indent=1, default=str)
for k, v in rep.items():
    print(f"{k}: {v}")
with open(os.path.join(work, "preflight.env"), "w") as f:
    f.write(f"ARCH={rep.get('arch', '')}\nHAVE_GPU={int(bool(rep['cuda_available']))}\n"
            f"MISSING={shlex.quote('; '.join(missing))}\n")
if missing:
    print(("PRE-FLIGHT (cpu mode, not stopping): missing " if dry else "PRE-FLIGHT FAILED: missing ")
          + "; ".join(missing))
sys.exit(0 if dry or not missing else 2)
PY
PREFLIGHT_CAP=30
t0=$SECONDS rc=0
timeout "$PREFLIGHT_CAP" "$PY" "$WORK/preflight.py" "$WORK" "$DRY" >>"$WORK/preflight.log" 2>&1 || rc=$?
case $rc in 0) st=ok ;; 2) st="failed (missing)" ;; 124|137) st=timeout ;; *) st="failed($rc)" ;; esac
record preflight "$st" "$((SECONDS - t0))" "$PREFLIGHT_CAP"
ARCH="" HAVE_GPU=0 MISSING=""
# shellcheck disable=SC1091
[[ -f $WORK/preflight.env ]] && source "$WORK/preflight.env"
((HAVE_GPU)) || DRY=1
if ((DRY)); then MODE=cpu; else MODE=gpu; fi
echo "gpu_lease: mode $MODE, arch ${ARCH:-none}, DSPARK_TEST_SEED=$DSPARK_TEST_SEED, budget ${BUDGET}s, work $WORK" |
  tee -a "$WORK/preflight.log"
STOP=0
if [[ $MODE == gpu && -n $MISSING ]]; then
  echo "PRE-FLIGHT FAILED, stopping before the build: missing $MISSING" | tee -a "$WORK/preflight.log"
  STOP=1
fi
archive

if ((STOP)); then
  for s in build tests_first sanitizer_tickets tests_ops tests_graphs kernels e2e sanitizer; do
    skip_step $s "pre-flight failed"
  done
else
  # ---- build in place, this device's architecture only (tests import the fresh .so) -------
  if [[ ${DSPARK_LEASE_FAIL_BUILD:-0} == 1 ]]; then
    run_step build 100 bash -c 'echo "DSPARK_LEASE_FAIL_BUILD=1: the build fails without building" >&2; exit 1'
  elif [[ $MODE == gpu ]]; then
    run_step build 100 bash -c "DSPARK_CUDA=1 DSPARK_CUDA_ARCHS='${DSPARK_CUDA_ARCHS:-$ARCH}' DSPARK_PTXAS_VERBOSE=1 \
      '$PY' setup.py build_ext --inplace && '$PY' -c 'import sys, dspark_rt._C as m; i = m.build_info(); print(i); sys.exit(0 if i[\"cuda\"] else 1)'"
  else
    run_step build 100 bash -c "DSPARK_CUDA=0 '$PY' setup.py -q build_ext --inplace && '$PY' -c 'import dspark_rt._C as m; print(m.build_info())'"
  fi
  grep -E "ptxas info|bytes stack frame|spill" "$WORK/build.log" >"$WORK/ptxas.txt" 2>/dev/null || true
  BUILD_STATUS=$(awk -F'\t' '$1 == "build" {print $2}' "$STEPS")
  if [[ $BUILD_STATUS != ok && $BUILD_STATUS != skipped* ]]; then
    # Nothing after a failed build measures a kernel (the tests skip, the benchmarks would time
    # the reference ops): stop here, every later step marked.
    echo "BUILD $BUILD_STATUS: every later step is skipped (see build.log)" | tee -a "$WORK/build.log"
    STOP=1
    for s in tests_first sanitizer_tickets tests_ops tests_graphs kernels e2e sanitizer; do skip_step $s "build failed"; done
  fi
fi
# ---- compute-sanitizer on the torch-free driver ---------------------------------------------------
# The ops run from bench/sanitize_ops.py, which imports neither torch nor dspark_rt (torch's
# thousands of kernels make a sanitized process take minutes to start): cupy buffers, _C
# loaded from its file. CPU mode runs the same driver on the C++ kernels, unsanitized.
SANITIZE=("$PY" bench/sanitize_ops.py)
SAN_OK=""  # GPU mode: "yes" once the probe passed, else why the sanitizer steps are skipped
sanitizer_probe() {
  if ! command -v compute-sanitizer >/dev/null 2>&1; then SAN_OK="compute-sanitizer not found"; return; fi
  local probe=$WORK/sanitizer_probe
  cat >"$probe.cu" <<'CU'
#include <cstdio>
__global__ void Touch(int* p) { p[threadIdx.x] = threadIdx.x; }
int main() {
  int* p = nullptr;
  if (cudaMalloc(&p, 32 * sizeof(int)) != cudaSuccess) return 2;
  Touch<<<1, 32>>>(p);
  cudaError_t e = cudaDeviceSynchronize();
  std::printf("probe: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 3;
}
CU
  run_step sanitizer_probe 20 bash -c "nvcc -arch=sm_${ARCH} -o '$probe' '$probe.cu' && compute-sanitizer --error-exitcode=5 '$probe'"
  case $(tail -1 "$STEPS" | cut -f2) in
    ok) SAN_OK=yes ;;
    "skipped (budget spent)") SAN_OK="budget spent" ;;
    *) SAN_OK="the device refuses compute-sanitizer: $(grep -m1 -iE 'not supported|error' "$WORK/sanitizer_probe.log" | cut -c1-80)" ;;
  esac
}
# sanitize NAME CASES CAP: the driver's CASES under memcheck, then racecheck (NAME_memcheck,
# NAME_racecheck; CPU mode: NAME_cpu, once, unsanitized)
sanitize() {
  local name=$1 cases=$2 cap=$3
  if [[ $SKIP == *",sanitizer,"* ]]; then skip_step "$name" "--skip"; return 0; fi
  if [[ $MODE == cpu ]]; then run_step "${name}_cpu" "$cap" "${SANITIZE[@]}" --device cpu --cases "$cases"; return 0; fi
  [[ -n $SAN_OK ]] || sanitizer_probe
  if [[ $SAN_OK != yes ]]; then skip_step "$name" "$SAN_OK"; return 0; fi
  for tool in memcheck racecheck; do
    run_step "${name}_$tool" "$cap" compute-sanitizer --tool=$tool --error-exitcode=3 "${SANITIZE[@]}" --device cuda \
      --cases "$cases"
  done
}

if ((!STOP)); then
  # ---- tests (GPU: run; CPU: collected only, so a wrong path or marker shows here) --------
  PYTEST=("$PY" -m pytest -p no:cacheprovider -m gpu -v -rfE)
  ((DRY)) && PYTEST+=(--collect-only -qq)  # with -v: one node id a line
  junit() { ((DRY)) || echo "$WORK/$1.xml"; }  # GPU mode: a run that passed nothing has failed
  # The newest kernel paths first (the fused split merge and its tickets, the planner's splits,
  # the rejection residual, CuPy arrays, every output written), then their atomic tickets under
  # the sanitizer, then the rest of the op tests.
  FIRST="fused_merge or merge_tickets or merge_in_graph or plan_splits or cold_residual or cupy"
  JUNIT=$(junit tests_first) run_step tests_first 40 "${PYTEST[@]}" tests/ops/test_ops_outputs.py \
    tests/ops/test_nonfinite_drafts.py tests/ops/test_ops_cuda.py -k "not test_ops_cuda or ($FIRST)" \
    --junitxml="$WORK/tests_first.xml"
  sanitize sanitizer_tickets tickets 25
  JUNIT=$(junit tests_ops) run_step tests_ops 110 "${PYTEST[@]}" tests/ops/test_ops_cuda.py \
    -k "not sanitizer and not ($FIRST)" --junitxml="$WORK/tests_ops.xml"
  JUNIT=$(junit tests_graphs) run_step tests_graphs 50 "${PYTEST[@]}" tests/runner/test_graphs.py \
    tests/e2e/test_lossless.py --junitxml="$WORK/tests_graphs.xml"

  # ---- every kernel benchmark, goal shapes, one process, one JSON ---------------------------
  # (verify_attention first; the eager references at each op's smallest shape only)
  if [[ $MODE == gpu ]]; then
    run_step kernels 100 "$PY" bench/bench_kernels.py --device cuda --flex "$FLEX" --ref first \
      --json "$WORK/kernels.json"
  else
    run_step kernels 100 "$PY" bench/bench_kernels.py --device cpu --quick --ref first --json "$WORK/kernels.json"
  fi

  # ---- trimmed end to end ------------------------------------------------------------------
  if [[ $MODE == gpu ]]; then
    run_step e2e 80 "$PY" bench/bench_e2e.py --device cuda --model qwen3-8b --accept-prob 0.8 \
      --batch 1 32 --max-tokens 16 --prompt-len 512 --profile-seconds 2 \
      --modes ar/fixed dspark/fixed dspark/async --json "$WORK/e2e.json" --plot "$WORK/e2e.png"
  else  # the tiny random pair's config is rejected by the checkpoint checks: the shipped pair
    run_step e2e 80 "$PY" bench/bench_e2e.py --device cpu --batch 1 --max-tokens 4 \
      --modes ar/fixed dspark/fixed --json "$WORK/e2e.json" --plot "$WORK/e2e.png"
  fi

  # ---- compute-sanitizer on every op, last, in the time left ----------------------------------
  sanitize sanitizer all 60
fi

# ---- summary (one screen) and the archive ------------------------------------------------------
export LEASE_ARGS="${ARGS[*]}"  # what the printed rerun command repeats
"$PY" - "$WORK" "$MODE" "$BUDGET" "$((SECONDS - T0))" "$ROOT" <<'PY' 2>&1 | tee "$WORK/summary.txt"
import glob, importlib.util, json, os, re, sys, xml.etree.ElementTree as ET
work, mode, budget, used, root = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
load = lambda name: json.load(open(os.path.join(work, name))) if os.path.exists(os.path.join(work, name)) else None
pre = load("preflight.json") or {}
s = {"mode": mode, "budget_s": budget, "used_s": used, "seed": os.environ.get("DSPARK_TEST_SEED"),
     "gpu": pre.get("gpu"), "arch": pre.get("arch"), "missing": pre.get("missing"), "steps": [],
     "tests": {}, "kernels": [], "e2e": []}
for line in open(os.path.join(work, "steps.tsv")):
    name, *status, secs, limit = line.rstrip("\n").split("\t")
    status = " ".join(status)
    s["steps"].append({"step": name, "status": status, "seconds": int(secs), "limit": int(limit)})
for name in ("tests_first", "tests_ops", "tests_graphs"):
    xml, log = os.path.join(work, name + ".xml"), os.path.join(work, name + ".log")
    c = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if os.path.exists(xml) and mode == "gpu":
        for t in ET.parse(xml).getroot().iter("testcase"):
            tid = f"{t.get('classname')}::{t.get('name')}"
            if t.find("failure") is not None or t.find("error") is not None:
                c["failed"] += 1
                c["failures"].append(tid)
            elif t.find("skipped") is not None:
                c["skipped"] += 1
            else:
                c["passed"] += 1
    elif os.path.exists(log):  # cut off before pytest wrote its XML: count the -v lines
        text = open(log, errors="replace").read()
        for k, word in (("passed", "PASSED"), ("failed", "FAILED"), ("skipped", "SKIPPED")):
            c[k] = len(re.findall(rf"::\S+ {word}", text))
        c["failures"] = re.findall(r"(\S+::\S+) (?:FAILED|ERROR)", text)[:20]
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", text)
        if mode == "cpu" and m:
            c["collected"] = int(m.group(1))
    else:
        continue
    s["tests"][name] = c
kern = load("kernels.json") or {}
for op, res in kern.get("ops", {}).items():
    if "error" in res:
        s["kernels"].append({"op": op, "error": res["error"]})
    for r in res.get("rows", []):
        s["kernels"].append({"op": op, **{k: r.get(k) for k in ("shape", "us", "gbps", "frac_of_floor",
                                                            "ratio_vs_base", "ratio_vs_ref", "timed", "flex_us",
                                                            "ratio_vs_flex")}})
e2e = load("e2e.json") or {}
s["e2e"] = [{k: r.get(k) for k in ("mode", "policy", "batch", "tokens_per_s", "tau")} for r in e2e.get("rows", [])]
if e2e.get("rows") and not os.path.exists(os.path.join(work, "e2e.png")):
    try:  # the run was cut short before its plot: draw it from the rows it kept
        spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(root, "bench", "bench_e2e.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.plot(e2e["rows"], os.path.join(work, "e2e.png"), f"{e2e.get('model')} (partial run)")
    except Exception as e:
        s["e2e_plot_error"] = repr(e)
spill = [l.strip() for l in open(os.path.join(work, "ptxas.txt"), errors="replace")
         if "spill" in l and " 0 bytes spill stores, 0 bytes spill loads" not in l] \
    if os.path.exists(os.path.join(work, "ptxas.txt")) else []
s["ptxas_spill_lines"] = spill


def verdict():
    """(ran, why): did any step run a CUDA kernel of this build, and what shows it (or why not)."""
    st = {x["step"]: x["status"] for x in s["steps"]}
    if st.get("preflight", "").startswith("failed") and mode == "gpu" or \
            st.get("build", "").startswith("skipped (pre-flight"):
        return False, f"pre-flight failed (missing {'; '.join(s['missing'] or []) or '?'})"
    if not (st.get("build", "ok") == "ok" or st["build"].startswith("skipped (--skip")):
        return False, f"build {st['build']}"
    if mode != "gpu":
        return False, "cpu mode (no GPU: the C++ CPU kernels and the reference ops only)"
    shown = [f"{n} {c['passed']} passed" for n, c in s["tests"].items() if c["passed"]]
    cuda_rows = lambda res: "cuda" in ((res or {}).get("header") or {}).get("backends", [])
    rows = sum(len(r.get("rows", [])) for r in kern.get("ops", {}).values()) if cuda_rows(kern) else 0
    if rows:
        shown.append(f"kernels {rows} rows")
    if e2e.get("rows") and cuda_rows(e2e):
        shown.append(f"e2e {len(e2e['rows'])} rows")
    if not shown:
        return False, "no step ran a CUDA kernel (no GPU test passed, no benchmark row with the cuda backend)"
    return True, ", ".join(shown)


def rerun():
    """The command that reruns what did not finish, reusing the in-place build of this machine."""
    steps = ["build", "tests_first", "tests_ops", "tests_graphs", "kernels", "e2e", "sanitizer"]
    again = set()
    for x in s["steps"]:
        name = "sanitizer" if x["step"].startswith("sanitizer") else x["step"]
        if x["status"].startswith(("failed", "timeout", "skipped (build failed", "skipped (budget",
                                   "skipped (pre-flight")):
            again.add(name)
    if "preflight" in again:
        return None
    if not again:
        return ""
    if "build" in again:  # a new build invalidates everything measured after it
        again |= set(steps)
    skip = [n for n in steps if n not in again]
    return " ".join(["bash bench/gpu_lease.sh"] + (["--skip", ",".join(skip)] if skip else [])
                    + os.environ.get("LEASE_ARGS", "").split())


ran, why = verdict()
s["kernels_ran"], s["kernels_ran_why"], s["rerun"] = ran, why, rerun()
json.dump(s, open(os.path.join(work, "summary.json"), "w"), indent=1, default=str)

print(f"KERNELS RAN: {why}" if ran else f"KERNELS DID NOT RUN: {why}")
print(f"== gpu_lease summary: mode {mode}, {s['gpu'] or 'no GPU'}, arch {s['arch'] or '-'}, "
      f"DSPARK_TEST_SEED={s['seed']}, {used} s of {budget} s")
if s["missing"]:
    print(f"   missing: {'; '.join(s['missing'])}")
for st in s["steps"]:
    print(f"   {st['step']:<20}{st['status']:<32}{st['seconds']:>4} s  (limit {st['limit']})")
for name, c in s["tests"].items():
    extra = f", {c['collected']} collected (cpu: not run)" if "collected" in c else ""
    print(f"   {name:<20}{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped{extra}"
          + (f"; failed: {', '.join(c['failures'][:3])}" if c["failures"] else ""))
if spill:
    print(f"   ptxas spills: {len(spill)} kernels, e.g. {spill[0][:70]}")
f = lambda x, spec: format(x, spec) if isinstance(x, (int, float)) else "-"
if s["kernels"]:
    print(f"   {'kernel':<17}{'shape':<44}{'us':>9}{'GB/s':>8}{'floor':>7}{'x_base':>8}")
for k in s["kernels"]:
    if "error" in k:
        print(f"   {k['op']:<17}ERROR {k['error'][:60]}")
        continue
    print(f"   {k['op']:<17}{k['shape'][:43]:<44}{f(k['us'], '9.1f')}{f(k['gbps'], '8.1f')}"
          f"{f(k['frac_of_floor'], '7.3f')}{f(k['ratio_vs_base'], '8.2f')}")
    if k.get("flex_us"):
        print(f"   {'':<17}FlexAttention over the paged cache {k['flex_us']:.1f} us: "
              f"kernel {f(k['ratio_vs_flex'], '.2f')}x")
for r in s["e2e"]:
    print(f"   e2e {r['mode'] + '/' + r['policy']:<16} batch {r['batch']:>3}: {f(r['tokens_per_s'], '.1f')} tok/s, "
          f"tau {f(r['tau'], '.2f')}")
if s["rerun"] is None:
    print("   rerun: the pre-flight failed; fix what it names, then run the whole script again")
elif s["rerun"]:
    kept = "" if "--skip build" not in s["rerun"] else "; it keeps this run's build"
    print(f"   rerun on the still-warm machine (start it within ~30 s{kept}):\n   {s['rerun']}")
else:
    print("   rerun: nothing failed")
PY
cp -f "$WORK/summary.json" "$WORK/summary.txt" "$OUT/" 2>/dev/null
archive
echo "gpu_lease: wrote $OUT/gpu_lease.tar.gz ($(du -h "$OUT/gpu_lease.tar.gz" 2>/dev/null | cut -f1)) in $((SECONDS - T0)) s"
grep -qE $'\t(failed|timeout|skipped \\((build failed|pre-flight failed|budget spent)\\))' "$STEPS" && exit 1
# GPU mode: a run that ran no kernel has failed whatever its steps say
[[ $MODE == gpu ]] && ! grep -q '"kernels_ran": true' "$WORK/summary.json" && exit 1
exit 0
