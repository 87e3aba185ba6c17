"""The one timing helper of the kernel benchmarks (STYLE "Benchmarks", DESIGN §7).

* `time_us(fn, device)` -> (µs, how): warm-up excluded, median of many runs. CUDA: CUDA events
  around a CUDA-graph replay of fn where fn can be captured (so the Python door and launch
  gaps are not in the window; how = "graph"), else around fn itself (how = "eager"). Before
  every run L2 is flushed by READING a buffer larger than it (a sum into a scalar): writing
  one would leave dirty lines whose write-back lands inside the timed window. setup() (inputs
  an op overwrites, fills) runs before the flush, outside the window. CPU: time.perf_counter.
  `median_us` is the same, eager only, returning µs alone.
* `ceilings(device, dtype)`: the copy bandwidth (and matrix rate) measured in the same process,
  once per process and dtype, so "fraction of the floor" compares against this machine now.
* `l2_bytes(device)`: the last-level cache, for byte counts that depend on what stays cached.
* `header(device)`: the machine, library versions, and on CUDA driver, clocks and power limit.
* `Report`: per shape µs, bytes and FLOPs counted, achieved GB/s, fraction of the floor, the
  ratio to the eager PyTorch reference and to the op's plain-torch baseline (each bench names
  it: cuBLAS + torch sampling, SDPA, torch.topk, ...) timed in the same run, and to its
  torch.compile with `--compile`; `--json PATH` for machines.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

_FLUSH = {}
_CEIL = {}
_QUICK = {"on": False}  # --quick: at most one warm-up and one run per measurement (a smoke test)


def add_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="PATH", help="also write header and rows as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and runs (smoke test)")
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile of the reference (ops whose reference is "
                         "loop-free tensor code: markov_sample, prefix_topk)")
    return ap


def parse_args(doc: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_args(ap).parse_args(argv)


def compiled_us(fn, device, **kw):
    """median_us of torch.compile(fn) (compilation happens in the warm-up); None, with the
    reason printed, when compilation fails on this machine."""
    import torch._dynamo
    torch._dynamo.reset()
    cfn = torch.compile(fn, dynamic=False)
    try:
        return median_us(cfn, device, warmup=2, **kw)
    except Exception as e:  # a missing C++ toolchain or an unsupported op: say so, keep going
        print(f"  torch.compile of the reference failed: {type(e).__name__}: {str(e)[:120]}")
        return None


def why(e: Exception) -> str:
    """An exception in one line, for the benchmark logs."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:120] if text else ''}"


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def l2_bytes(device) -> int:
    """L2 of a GPU; on the CPU the largest cache level sysfs lists (0 when unknown)."""
    if torch.device(device).type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, idx, "size")) as f:
                s = f.read().strip()
            best = max(best, int(s.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(s[-1:], 1))
        except (OSError, ValueError):  # not a cache level folder
            continue
    return best


def _flush_l2(device):
    """Reads (never writes) a buffer of 4x L2, at least 256 MiB, so the next run starts cold:
    the previous run's lines are evicted, and their write-backs happen here, not in the window."""
    key = str(device)
    if key not in _FLUSH:
        n = max(4 * l2_bytes(device), 256 << 20) // 4
        buf = torch.ones(n, dtype=torch.float32, device=device)
        _FLUSH[key] = (buf, torch.empty((), dtype=torch.float32, device=device))
        sync(device)
    buf, acc = _FLUSH[key]
    torch.sum(buf, dim=0, out=acc)


def _capture(fn, device, setup):
    """A CUDA graph of fn, or None when fn cannot be captured (a host sync, a cudaMalloc
    outside PyTorch's allocator, ...)."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for _ in range(2):
                if setup:
                    setup()
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        if setup:
            setup()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        sync(device)
        return g
    except Exception as e:  # eager timing instead; say why
        print(f"  (not capturable, timed eagerly: {why(e)})")
        try:
            sync(device)
        except Exception:
            pass
        return None


def time_us(fn, device, *, warmup=2, runs=25, budget_s=3.0, setup=None, graph=True):
    """(median µs of fn, "graph" | "eager" | "cpu"). See the module docstring."""
    cuda = torch.device(device).type == "cuda"
    how = "cpu" if not cuda else "eager"
    if _QUICK["on"]:
        warmup, runs, budget_s = min(warmup, 1), 1, 0.0
    if cuda and graph:
        g = _capture(fn, device, setup)
        if g is not None:
            fn, how = g.replay, "graph"
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync(device)
    times, spent = [], 0.0
    while len(times) < runs and (len(times) < 3 or spent < budget_s):
        if setup:
            setup()
        if cuda:
            _flush_l2(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e6
        times.append(t)
        spent += t * 1e-6
    return statistics.median(times), how


def baseline_us(fn, device, **kw):
    """time_us(fn)[0] of a baseline, or None with the reason printed: a baseline that fails on
    this torch or device must not cost the kernel's row."""
    try:
        return time_us(fn, device, **kw)[0]
    except Exception as e:
        print(f"  baseline failed: {why(e)}")
        return None


def median_us(fn, device, *, warmup=2, runs=25, budget_s=3.0, setup=None) -> float:
    """Median µs of fn() called eagerly (CUDA: launch gaps included), L2 flushed by reading."""
    return time_us(fn, device, warmup=warmup, runs=runs, budget_s=budget_s, setup=setup, graph=False)[0]


def ceilings(device, dtype) -> dict:
    """Copy bandwidth (GB/s, read + write counted) and matmul rate (TFLOP/s) measured now, once
    per process (the copy) and dtype (the matmul)."""
    cuda = torch.device(device).type == "cuda"
    key = str(device)
    if key not in _CEIL:
        n = (1 << 30 if cuda else 1 << 27) // 4  # 1 GiB on GPU, 128 MiB on CPU (past the caches)
        src = torch.ones(n, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        us = median_us(lambda: dst.copy_(src), device, runs=10)
        _CEIL[key] = 2 * src.numel() * 4 / us / 1e3
        del src, dst
    if (key, dtype) not in _CEIL:
        m = 8192 if cuda else 1024
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        _CEIL[key, dtype] = 2 * m**3 / median_us(lambda: a @ b, device, runs=10) / 1e6
    return {"copy_gbps": _CEIL[key], "matmul_tflops": _CEIL[key, dtype],
            "matmul_dtype": str(dtype).replace("torch.", "")}


def header(device, quiet=False) -> dict:
    """Prints and returns what the numbers depend on."""
    from .. import ops
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "backends": ops.available_backends()}
    if ops._C is not None:
        info["extension"] = dict(ops._C.build_info())
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sms=p.multi_processor_count, torch_cuda=torch.version.cuda,
                    memory_gib=round(p.total_memory / 2**30, 1), l2_mib=round(l2_bytes(device) / 2**20, 1))
        try:
            from ..nvml import nvml_state
            idx = torch.device(device).index or 0
            nv = [g for g in nvml_state() if g["index"] == idx]
            if nv:
                info.update({k: nv[0][k] for k in ("driver", "sm_clock_mhz", "max_sm_clock_mhz",
                                                   "mem_clock_mhz", "power_limit_w")})
        except Exception as e:  # NVML is optional: say so rather than fail the benchmark
            info["nvml"] = f"unavailable ({e})"
    else:
        model = platform.processor()
        try:
            with open("/proc/cpuinfo") as f:
                model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        # CPU timings are only comparable within one run; the load says how busy the machine was.
        info.update(cpu=model, cores=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    if not quiet:
        print(" | ".join(f"{k}={v}" for k, v in info.items()))
    return info


def _fmt(x, width: int, prec: int) -> str:
    return f"{x:{width}.{prec}f}" if x else f"{'-':>{width}}"


class Report:
    """Collects rows: `add(shape, us, ref_us, bytes, flops, base_us=...)` prints one line per
    shape. `baseline` names what base_us times (the plain-torch way to do the op's job)."""

    def __init__(self, op: str, device, dtype, args, baseline: str = ""):
        self.op, self.device, self.args, self.baseline = op, device, args, baseline
        _QUICK["on"] = bool(getattr(args, "quick", False))
        self.info = header(device)
        self.ceil = ceilings(device, dtype)
        self.info.update(self.ceil, baseline=baseline)
        print(f"{op}: measured copy {self.ceil['copy_gbps']:.1f} GB/s, matmul "
              f"{self.ceil['matmul_tflops']:.2f} TFLOP/s ({self.ceil['matmul_dtype']}); "
              f"floor = max(bytes / copy, FLOPs / matmul)")
        print(f"  x_ref: speed-up over the eager reference; x_base: over the baseline, {baseline}")
        if torch.device(device).type == "cpu":
            print("  (CPU: the copy ceiling is measured past the caches, so inputs that fit in them "
                  "can beat the floor)")
        print(f"{'shape':<44}{'us':>10}{'ref_us':>11}{'x_ref':>7}{'base_us':>10}{'x_base':>7}"
              f"{'MB':>9}{'GFLOP':>8}{'GB/s':>8}{'floor':>7}")
        self.rows = []

    def add(self, shape: str, us: float, ref_us, nbytes: float, flops: float = 0.0, *,
            base_us=None, **extra):
        floor_us = max(nbytes / (self.ceil["copy_gbps"] * 1e3),
                       flops / (self.ceil["matmul_tflops"] * 1e6))
        row = dict(shape=shape, us=us, ref_us=ref_us, ratio_vs_ref=(ref_us / us) if ref_us else None,
                   base_us=base_us, ratio_vs_base=(base_us / us) if base_us else None,
                   bytes=nbytes, flops=flops, gbps=nbytes / us / 1e3, floor_us=floor_us,
                   frac_of_floor=floor_us / us, **extra)
        if row.get("compiled_ref_us"):
            row["ratio_vs_compiled_ref"] = row["compiled_ref_us"] / us
        self.rows.append(row)
        ref = _fmt(ref_us, 11, 0) + _fmt(row["ratio_vs_ref"], 7, 1)
        base = _fmt(base_us, 10, 1) + _fmt(row["ratio_vs_base"], 7, 2)
        comp = f"  compiled ref {row['compiled_ref_us']:.0f} us ({row['ratio_vs_compiled_ref']:.1f}x)" \
            if row.get("compiled_ref_us") else ""
        print(f"{shape:<44}{us:10.1f}{ref}{base}{nbytes / 1e6:9.2f}{flops / 1e9:8.3f}"
              f"{row['gbps']:8.1f}{row['frac_of_floor']:7.3f}{comp}", flush=True)
        if getattr(self.args, "on_row", None):  # bench_kernels: saves after every row
            self.args.on_row(self)
        return row

    def result(self) -> dict:
        return {"op": self.op, "header": self.info, "rows": self.rows}

    def finish(self) -> dict:
        if getattr(self.args, "json", None):
            with open(self.args.json, "w") as f:
                json.dump(self.result(), f, indent=2, default=str)
            print(f"wrote {self.args.json}")
        return self.result()


def backend_for(device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpp"


def free(device):
    """Returns cached device memory between shapes (goal shapes hold GBs each)."""
    import gc
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
