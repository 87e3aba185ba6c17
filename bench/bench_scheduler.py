"""Scheduler cost per round (host CPU, µs, median): sync (Algorithm 1, all of it) and async.

Async splits into the critical path (admission: ops.prefix_topk of the current survivals with
the planned K) and the off-critical-path budget search (plan_budget, run on survivals two
rounds old). `candidates` (cap / NaN masking, shared by both) is reported on its own.

Second table: the engine's RequestScheduler.schedule() per step for R requests that decode
(one position committed per step, a new page every page_size steps), with the target cache
alone (ar) and with a drafter cache whose context is deferred (dspark under policy auto).

    python bench/bench_scheduler.py [--json] [--repeats N]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from dspark_rt import ops
from dspark_rt.nvml import nvml_state
from dspark_rt.policies import BatchView, Decision
from dspark_rt.policies.prefix import AsyncScheduler, SyncScheduler, candidates
from dspark_rt.policies.sps import SPSProfile

SHAPES = [(R, gamma) for R in (1, 32, 256) for gamma in (7, 16)]


def jagged_profile(max_B: int, seed: int = 0) -> SPSProfile:
    """A plausible measured table: B measured every 16 tokens (step lookup in between), a fixed
    cost plus one step per 64-token tile, 1 % jitter."""
    rng = np.random.default_rng(seed)
    B = np.unique(np.r_[1, np.arange(16, max_B, 16), max_B])
    seconds = 8e-3 + 2e-4 * np.ceil(B / 64) + 2e-6 * B
    return SPSProfile(B.tolist(), (1.0 / seconds * (1 + 0.01 * rng.standard_normal(len(B)))).tolist())


def median_us(fn, inputs, repeats: int) -> float:
    for x in inputs[:3]:  # warm-up, excluded
        fn(*x)
    times = []
    for i in range(repeats):
        x = inputs[i % len(inputs)]
        t0 = time.perf_counter_ns()
        fn(*x)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def bench_shape(R: int, gamma: int, repeats: int) -> dict:
    rng = np.random.default_rng(R * 100 + gamma)
    prof = jagged_profile(R * (gamma + 1))
    cap = torch.full((R,), gamma, dtype=torch.int64)
    inputs = []
    for _ in range(16):  # fresh survivals, cycled
        c = torch.tensor(rng.beta(4, 1, size=(R, gamma)), dtype=torch.float32)
        inputs.append((Decision((gamma,) * R), c, torch.cumprod(c, 1), cap))
    sync, asy = SyncScheduler(prof), AsyncScheduler(prof)
    masked = [(candidates(s, k, gamma),) for _, _, s, k in inputs]
    view = BatchView(None, (gamma,) * R, (0,) * R, gamma)

    def async_round(d, c, s, k):  # the round's host path: the decision's budget, then admission
        return asy.lengths(asy.decide(view), c, s, k)
    K = [asy.plan_budget(a) for (a,) in masked]
    admit_in = [(a, k) for (a,), k in zip(masked, K)]
    row = {
        "R": R, "gamma": gamma,
        "sync_us": median_us(sync.lengths, inputs, repeats),
        "async_admit_us": median_us(asy.admit, admit_in, repeats),
        "async_plan_us": median_us(asy.plan_budget, masked, repeats),
        "candidates_us": median_us(candidates, [(s, k, gamma) for _, _, s, k in inputs], repeats),
        "async_round_us": median_us(async_round, inputs, repeats),
        "sync_len_mean": float(np.mean([sync.lengths(*x).float().mean() for x in inputs])),
        "async_K_mean": float(np.mean(K)),
    }
    return row


def request_schedule_us(R: int, drafter: bool, steps: int) -> float:
    """Median µs of RequestScheduler.schedule() over `steps` decoding steps of R requests."""
    from dspark_rt.engine.block_manager import BlockManager
    from dspark_rt.engine.scheduler import RequestScheduler, SchedRequest
    target = BlockManager(1 << 15, 16, name="target")
    draft = BlockManager(1 << 15, 16, name="drafter") if drafter else None
    gamma = 7 if drafter else 0
    sched = RequestScheduler(256, 8192, target, draft, gamma=gamma, block_size=gamma)
    reqs = [SchedRequest(i, list(range(1, 40 + i)), steps + 16) for i in range(R)]
    for r in reqs:
        sched.add(r)
    for chunk in sched.schedule().prefills:
        sched.prefilled(chunk)
        chunk.req.output_ids.append(5)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        times.append(time.perf_counter_ns() - t0)
        for r in out.decodes:
            r.output_ids.append(7)
            sched.decoded(r, 1, context=not drafter)
    return statistics.median(times) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--device", default="cpu", choices=["cpu"],
                    help="schedulers run on the host; kept for the bench-cpu Makefile loop")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a scheduler runs on one host thread beside the engine
    header = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "torch": torch.__version__,
              "prefix_topk_backend": "cpp" if "cpp" in ops.available_backends() else "reference",
              "gpus": nvml_state(), "repeats": args.repeats, "torch_threads": 1}
    rows = [bench_shape(R, gamma, args.repeats) for R, gamma in SHAPES]
    requests = [{"R": R, "ar_us": request_schedule_us(R, False, args.repeats),
                 "dspark_deferred_us": request_schedule_us(R, True, args.repeats)}
                for R in (1, 8, 32, 128)]
    if args.json:
        print(json.dumps({"header": header, "rows": rows, "request_scheduler": requests}, indent=1))
        return
    print(f"# {header['machine']} ({header['cpus']} CPUs), python {header['python']}, torch "
          f"{header['torch']}, prefix_topk backend {header['prefix_topk_backend']}, 1 thread, "
          f"median of {args.repeats}")
    print(f"{'R':>4} {'gamma':>5} | {'sync':>8} | {'async admit':>11} {'(off-path plan)':>15} "
          f"| {'masking':>8} {'async round':>11} | {'sync mean l':>11} {'mean K':>7}")
    for r in rows:
        print(f"{r['R']:>4} {r['gamma']:>5} | {r['sync_us']:>6.1f}us | {r['async_admit_us']:>9.1f}us "
              f"{r['async_plan_us']:>13.1f}us | {r['candidates_us']:>6.1f}us {r['async_round_us']:>9.1f}us"
              f" | {r['sync_len_mean']:>11.2f} {r['async_K_mean']:>7.1f}")
    print("\nRequestScheduler.schedule() per decoding step")
    print(f"{'R':>4} | {'ar':>8} | {'dspark, context deferred':>24}")
    for r in requests:
        print(f"{r['R']:>4} | {r['ar_us']:>6.1f}us | {r['dspark_deferred_us']:>22.1f}us")


if __name__ == "__main__":
    main()
