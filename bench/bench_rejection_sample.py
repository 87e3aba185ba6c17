"""rejection_sample (lossless acceptance): C++/CUDA kernel vs the eager PyTorch reference.

    python bench/bench_rejection_sample.py [--device cpu|cuda] [--json PATH] [--quick]

Shapes: CUDA R=128, gamma=7, V=151936; CPU (scaled down) R in {1, 8, 32}, gamma=7, V=32000.
float32 logits, every request verifies gamma drafts drawn from q close to P (long acceptances),
sampled rows. Bytes: every target row and draft row read once (what a one-pass kernel reads;
a kernel that stops at the first rejection reads less). FLOPs: none counted (exp-bound).
"""
import torch

from dspark_rt.testing.bench import Report, backend_for, median_us, parse_args

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402


def main():
    args = parse_args(__doc__)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.float32
    be = backend_for(dev)
    rep = Report("rejection_sample", dev, dtype, args)
    grid = [(128, 7, 151936)] if cuda else [(1, 7, 32000), (8, 7, 32000), (32, 7, 32000)]
    for R, G, V in grid[:2] if args.quick else grid:
        case = oc.RejectionCase(R, G, V, "full", "sampled", "likely")
        kw = oc.rejection_inputs(case, dev, dtype, gen_device=dev)
        args_ = [kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
        run = lambda backend: ops.rejection_sample(*args_, backend=backend, **kw)
        acc, out = run(be)
        racc, rout = run("reference")
        match = bool(torch.equal(acc, racc) and torch.equal(out, rout))
        us = median_us(lambda: run(be), dev)
        ref_us = median_us(lambda: run("reference"), dev, warmup=1, runs=5)
        nbytes = 4 * (R * (G + 1) * V + R * G * V) + 8 * R * (2 * G + 1)
        rep.add(f"R={R} gamma={G} V={V}", us, ref_us, nbytes, 0.0, outputs_match=match,
                mean_accepted=float(acc.float().mean()))
        if not match:
            print("  WARNING: outputs differ from the reference")
    rep.finish()


if __name__ == "__main__":
    main()
