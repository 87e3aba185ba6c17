"""The one timing helper of the kernel benchmarks (STYLE "Benchmarks", DESIGN §7).

* `median_us(fn, device)`: warm-up excluded, median of many runs. CUDA: CUDA events, with a
  large buffer rewritten before every run so L2 starts cold. CPU: time.perf_counter.
* `ceilings(device, dtype)`: the copy bandwidth (and matrix rate) measured in the same run, so
  "fraction of the floor" compares against this machine now, not a datasheet.
* `header(device)`: the machine, library versions, and on CUDA driver, clocks and power limit.
* `Report`: per shape µs, bytes and FLOPs counted, achieved GB/s, fraction of the floor and the
  ratio to the eager PyTorch reference timed in the same run (and to its torch.compile with
  `--compile`, where the reference is loop-free tensor code); `--json PATH` for machines.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

_FLUSH = {}


def parse_args(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="PATH", help="also write header and rows as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and runs (smoke test)")
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile of the reference (ops whose reference is "
                         "loop-free tensor code: markov_sample, prefix_topk)")
    return ap.parse_args()


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


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _flush_l2(device):
    """Rewrites a buffer larger than any L2 (H200: 60 MiB) so the next run starts cold."""
    buf = _FLUSH.get(str(device))
    if buf is None:
        buf = _FLUSH[str(device)] = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    buf.zero_()


def median_us(fn, device, *, warmup=2, runs=25, budget_s=3.0, setup=None) -> float:
    """Median wall time of fn() in µs. setup() (untimed) runs before every call, e.g. to
    restore inputs an op overwrites. Runs stop early once budget_s is spent (at least 3)."""
    cuda = torch.device(device).type == "cuda"
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
    return statistics.median(times)


def ceilings(device, dtype) -> dict:
    """Copy bandwidth (GB/s, read + write counted) and matmul rate (TFLOP/s) measured now."""
    cuda = torch.device(device).type == "cuda"
    n = (1 << 30 if cuda else 1 << 27) // 4  # 1 GiB on GPU, 128 MiB on CPU (past the caches)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), device, runs=10)
    m = 8192 if cuda else 1024
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm_us = median_us(lambda: a @ b, device, runs=10)
    return {"copy_gbps": 2 * src.numel() * 4 / us / 1e3, "matmul_tflops": 2 * m**3 / mm_us / 1e6,
            "matmul_dtype": str(dtype).replace("torch.", "")}


def header(device) -> dict:
    """Prints and returns what the numbers depend on."""
    from dspark_rt import ops
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "backends": ops.available_backends()}
    if ops._C is not None:
        info["extension"] = dict(ops._C.build_info())
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sms=p.multi_processor_count, torch_cuda=torch.version.cuda,
                    memory_gib=round(p.total_memory / 2**30, 1))
        try:
            from dspark_rt.nvml import nvml_state
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
    print(" | ".join(f"{k}={v}" for k, v in info.items()))
    return info


class Report:
    """Collects rows: `add(shape, us, ref_us, bytes, flops)` prints one line per shape."""

    def __init__(self, op: str, device, dtype, args):
        self.op, self.device, self.args = op, device, args
        self.info = header(device)
        self.ceil = ceilings(device, dtype)
        self.info.update(self.ceil)
        print(f"{op}: measured copy {self.ceil['copy_gbps']:.1f} GB/s, matmul "
              f"{self.ceil['matmul_tflops']:.2f} TFLOP/s ({self.ceil['matmul_dtype']}); "
              f"floor = max(bytes / copy, FLOPs / matmul)")
        print(f"{'shape':<44}{'us':>11}{'ref_us':>12}{'x_ref':>8}{'MB':>9}{'GFLOP':>8}"
              f"{'GB/s':>8}{'floor':>7}")
        self.rows = []

    def add(self, shape: str, us: float, ref_us, nbytes: float, flops: float = 0.0, **extra):
        floor_us = max(nbytes / (self.ceil["copy_gbps"] * 1e3),
                       flops / (self.ceil["matmul_tflops"] * 1e6))
        row = dict(shape=shape, us=us, ref_us=ref_us, ratio_vs_ref=(ref_us / us) if ref_us else None,
                   bytes=nbytes, flops=flops, gbps=nbytes / us / 1e3, floor_us=floor_us,
                   frac_of_floor=floor_us / us, **extra)
        if row.get("compiled_ref_us"):
            row["ratio_vs_compiled_ref"] = row["compiled_ref_us"] / us
        self.rows.append(row)
        ref = f"{ref_us:12.0f}{ref_us / us:8.1f}" if ref_us else f"{'-':>12}{'-':>8}"
        comp = f"  compiled ref {row['compiled_ref_us']:.0f} us ({row['ratio_vs_compiled_ref']:.1f}x)" \
            if row.get("compiled_ref_us") else ""
        print(f"{shape:<44}{us:11.1f}{ref}{nbytes / 1e6:9.2f}{flops / 1e9:8.3f}"
              f"{row['gbps']:8.1f}{row['frac_of_floor']:7.3f}{comp}", flush=True)

    def finish(self):
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"op": self.op, "header": self.info, "rows": self.rows}, f, indent=2)
            print(f"wrote {self.args.json}")


def backend_for(device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpp"
