"""markov_sample (the sequential drafting stage): C++/CUDA kernel vs the eager PyTorch reference.

    python bench/bench_markov_sample.py [--device cpu|cuda] [--json PATH] [--quick] [--compile]

Shapes: CUDA V=151936, r=256, d=4096, gamma in {7, 16}, R in {1, 32, 256}; CPU (scaled down,
the reference is slow) V=32000, r=64, d=256, gamma=7, R in {1, 8}. Dtypes as served: float32
logits always; bf16 hidden and head weights on CUDA (a bf16 model's head: W2 through tensor
cores), on the CPU both float32 weights (a float32 model) and bf16 weights (widened on load).
Vanilla head, Markov confidence feature, sampled rows (T in (0.3, 2)).
Bytes: float32 logits read and written (R gamma V), w2 swept once per step for the whole batch
(gamma V r, weight dtype), w1 rows, hidden, confidence weights, outputs.
FLOPs: 2 R gamma V r (projection).
"""
import torch

from dspark_rt.testing.bench import Report, backend_for, compiled_us, median_us, parse_args

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402
from dspark_rt.ops import reference  # noqa: E402


def shapes(cuda: bool, quick: bool):
    if cuda:
        V, r, d, grid = 151936, 256, 4096, [(R, g) for g in (7, 16) for R in (1, 32, 256)]
    else:
        V, r, d, grid = 32000, 64, 256, [(1, 7), (8, 7)]
    return V, r, d, grid[:2] if quick else grid


def main():
    args = parse_args(__doc__)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    weight_dtypes = [torch.bfloat16] if cuda else [torch.float32, torch.bfloat16]
    be = backend_for(dev)
    rep = Report("markov_sample", dev, weight_dtypes[0], args)
    V, r, d, grid = shapes(cuda, args.quick)
    for (R, G), wdt in ((g, w) for g in grid for w in weight_dtypes):
        case = oc.MarkovCase(R, G, V, "vanilla", rank=r, d=d, conf="markov", temps="sampled")
        kw = oc.markov_inputs(case, dev, torch.float32, gen_device=dev)
        for k in ("hidden", "w1", "w2", "conf_w", "conf_b"):
            kw[k] = kw[k].to(wdt)
        U0 = kw.pop("logits")
        logits = U0.clone()
        hidden, anchor, head = kw.pop("hidden"), kw.pop("anchor"), kw.pop("head")
        run = lambda backend: ops.markov_sample(logits, hidden, anchor, head, backend=backend, **kw)
        restore = lambda: logits.copy_(U0)
        # Benchmarked inputs are checked inputs: the tokens must be the reference's.
        restore()
        ours = run(be)[0].clone()
        restore()
        ref = run("reference")[0]
        match = float((ours == ref).double().mean())
        us = median_us(lambda: run(be), dev, setup=restore)
        ref_us = median_us(lambda: run("reference"), dev, setup=restore, warmup=1, runs=5)
        extra = {}
        if args.compile:
            extra["compiled_ref_us"] = compiled_us(
                lambda: reference.markov_sample(logits, hidden, anchor, head, **kw), dev,
                setup=restore, runs=5)
        s = torch.finfo(wdt).bits // 8
        nbytes = 4 * 2 * R * G * V + s * (G * V * r + R * G * (2 * r + d) + d + r) + 8 * 4 * R * G
        rep.add(f"R={R} gamma={G} V={V} r={r} weights={str(wdt)[6:]}", us, ref_us, nbytes, 2 * R * G * V * r,
                tokens_match=match, **extra)
        if match < 1:
            print(f"  WARNING: {100 * (1 - match):.2f}% of tokens differ from the reference")
    rep.finish()


if __name__ == "__main__":
    main()
