"""prefix_topk (admission of the top-K draft candidates): kernel vs the eager PyTorch reference
and torch.topk.

    python bench/bench_prefix_topk.py [--device cpu|cuda] [--json PATH] [--quick] [--compile]

Shapes (both devices; the goal shapes): R in {1, 32, 256}, gamma in {7, 16}, K = R gamma / 2,
survivals non-increasing in j (cumulative products). Bytes the op must move: the survivals
read once (4 R gamma) and the lengths written (4 R). Latency-bound: the floor is far below a
launch. Baseline: torch.topk of the flattened survivals and a scatter-add of the winners' rows
into lengths (no host sync). Kernel and baseline are timed by CUDA-graph replay on CUDA.
"""
import torch

from dspark_rt.testing.bench import (Report, backend_for, baseline_us, compiled_us, median_us, parse_args,
                                     time_us)

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402
from dspark_rt.ops import reference  # noqa: E402

BASELINE = "torch.topk + scatter_add of rows"


def torch_baseline(survival, K):
    R, G = survival.shape
    idx = torch.topk(survival.flatten(), K, sorted=False).indices
    return torch.zeros(R, dtype=torch.int64, device=survival.device).scatter_add_(
        0, idx // G, torch.ones_like(idx))


def run(args) -> dict:
    dev = torch.device(args.device)
    be = backend_for(dev)
    rep = Report("prefix_topk", dev, torch.float32, args, baseline=BASELINE)
    grid = [(R, g) for g in (7, 16) for R in (1, 32, 256)]
    for R, G in grid[:2] if args.quick else grid:
        survival, _ = oc.prefix_topk_inputs(oc.PrefixTopkCase(R, G), dev, gen_device=dev)
        K = R * G // 2
        ours = ops.prefix_topk(survival, K, backend=be)
        match = bool(torch.equal(ours, ops.prefix_topk(survival, K, backend="reference")))

        us, how = time_us(lambda: ops.prefix_topk(survival, K, backend=be), dev, runs=200)
        ref_us = median_us(lambda: ops.prefix_topk(survival, K, backend="reference"), dev, runs=200) \
            if getattr(rep.args, "ref", "all") == "all" or not rep.rows else None  # --ref first: the smallest shape only
        base_us = baseline_us(lambda: torch_baseline(survival, K), dev, runs=200)
        base_match = bool(torch.equal(ours.long(), torch_baseline(survival, K))) if base_us else None
        extra = {}
        if args.compile:
            extra["compiled_ref_us"] = compiled_us(lambda: reference.prefix_topk(survival, K), dev,
                                                   runs=200)
        rep.add(f"R={R} gamma={G} K={K}", us, ref_us, 4 * R * G + 4 * R, 0.0, base_us=base_us,
                timed=how, outputs_match=match, baseline_match=base_match, **extra)
        if not match:
            print("  WARNING: lengths differ from the reference")
    return rep.finish()


def main(argv=None):
    run(parse_args(__doc__, argv))


if __name__ == "__main__":
    main()
