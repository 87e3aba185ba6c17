"""prefix_topk (admission of the top-K draft candidates): kernel vs the eager PyTorch reference.

    python bench/bench_prefix_topk.py [--device cpu|cuda] [--json PATH] [--quick] [--compile]

Shapes (both devices): R in {1, 32, 256}, gamma in {7, 16}, K = R gamma / 2, survivals
non-increasing in j (cumulative products). Latency-bound: bytes are the survivals read and the
lengths written; the floor is far below launch overhead.
"""
import torch

from dspark_rt.testing.bench import Report, backend_for, compiled_us, median_us, parse_args

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402
from dspark_rt.ops import reference  # noqa: E402


def main():
    args = parse_args(__doc__)
    dev = torch.device(args.device)
    be = backend_for(dev)
    rep = Report("prefix_topk", dev, torch.float32, args)
    grid = [(R, g) for g in (7, 16) for R in (1, 32, 256)]
    for R, G in grid[:2] if args.quick else grid:
        survival, _ = oc.prefix_topk_inputs(oc.PrefixTopkCase(R, G), dev, gen_device=dev)
        K = R * G // 2
        match = bool(torch.equal(ops.prefix_topk(survival, K, backend=be),
                                 ops.prefix_topk(survival, K, backend="reference")))
        us = median_us(lambda: ops.prefix_topk(survival, K, backend=be), dev, runs=200)
        ref_us = median_us(lambda: ops.prefix_topk(survival, K, backend="reference"), dev, runs=200)
        extra = {}
        if args.compile:
            extra["compiled_ref_us"] = compiled_us(lambda: reference.prefix_topk(survival, K), dev,
                                                   runs=200)
        rep.add(f"R={R} gamma={G} K={K}", us, ref_us, 4 * R * G + 4 * R, 0.0, outputs_match=match,
                **extra)
        if not match:
            print("  WARNING: lengths differ from the reference")
    rep.finish()


if __name__ == "__main__":
    main()
