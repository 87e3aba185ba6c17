"""linear (the target's projections, row-invariant): kernel vs torch's own GEMM.

    python bench/bench_linear.py [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--json PATH] [--quick]

Shapes: the Qwen3-0.6B projections (q 2048x1024, gate/up 3072x1024, down 1024x3072) and a
37,984-row slice of its LM head (a quarter of 151,936) on the CPU; Qwen3-8B's (q 4096x4096,
gate/up 12288x4096, down 4096x12288) on CUDA; M (rows) in {1, 8, 64, 512}: a decoding step, a
verify of gamma + 1, a batch, a prefill chunk. Bytes the op must move: the weights once
(2 or 4 N K), x and out (M K + M N elements); FLOPs 2 M N K. The reference and the baseline
are both torch's GEMM here (the reference widens to float32 first, the baseline is F.linear in
the dtype as the model ran it before): x_base is what exactness costs (> 1: it pays). Each
shape also checks row invariance: every row of the M-row call equals the same row computed
alone, bitwise (`rows_invariant`).
"""
import argparse

import torch
import torch.nn.functional as F

from dspark_rt import ops
from dspark_rt.testing.bench import Report, add_args, backend_for, baseline_us, free, median_us, time_us

BASELINE = "torch F.linear in the model dtype"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_SHAPES = [("q_proj", 2048, 1024), ("gate_proj", 3072, 1024), ("down_proj", 1024, 3072),
              ("lm_head/4", 37984, 1024)]
CUDA_SHAPES = [("q_proj", 4096, 4096), ("gate_proj", 12288, 4096), ("down_proj", 4096, 12288)]


def run(args) -> dict:
    dev = torch.device(args.device)
    be = backend_for(dev)
    dtype = DTYPES[args.dtype]
    rep = Report("linear", dev, dtype, args, baseline=BASELINE)
    shapes = CUDA_SHAPES if dev.type == "cuda" else CPU_SHAPES
    rows_m = (1, 8) if args.quick else (1, 8, 64, 512)
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, N, K in shapes[:2] if args.quick else shapes:
        w = (torch.randn(N, K, device=dev, generator=gen) * K ** -0.5).to(dtype)
        x_all = torch.randn(max(rows_m), K, device=dev, generator=gen).to(dtype)
        for M in rows_m:
            x = x_all[:M].contiguous()
            us, how = time_us(lambda: ops.linear(x, w, backend=be), dev, runs=20)
            ref_us = median_us(lambda: ops.linear(x, w, backend="reference"), dev, runs=10) \
                if getattr(args, "ref", "all") == "all" or not rep.rows else None
            base_us = baseline_us(lambda: F.linear(x, w), dev, runs=20)
            y = ops.linear(x, w, backend=be)
            alone = torch.cat([ops.linear(x[i:i + 1], w, backend=be) for i in range(min(M, 8))])
            el = w.element_size()
            rep.add(f"{name} {N}x{K} M={M}", us, ref_us, el * (N * K + M * K + M * N),
                    2.0 * M * N * K, base_us=base_us, timed=how,
                    rows_invariant=bool(torch.equal(alone, y[:alone.shape[0]])))
        del w, x_all
        free(dev)
    return rep.finish()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
