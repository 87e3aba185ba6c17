"""markov_sample (the sequential drafting stage): C++/CUDA kernel vs the eager PyTorch reference
and a plain-torch baseline (cuBLAS projection + torch sampling).

    python bench/bench_markov_sample.py [--device cpu|cuda] [--json PATH] [--quick] [--compile]

Shapes: CUDA (the goal shapes) V=151936, r=256, d=4096, gamma in {7, 16}, R in {1, 32, 256};
CPU (scaled down, the reference is slow) V=32000, r=64, d=256, gamma=7, R in {1, 8} (--quick: 1, 2). Dtypes as
served: float32 z always; bf16 hidden and head weights on CUDA (a bf16 model's head: W2
through tensor cores) with the LM head's bf16 U read as it is and z written out of place, on
the CPU both float32 weights (a float32 model: U float32, z in place) and that bf16 setup.
Vanilla head, Markov confidence feature, sampled rows (T in (0.3, 2)).

Bytes the op must move (s = weight dtype size):
  U read (float32, or bf16 with bf16 weights), z written (float32): (s_U + 4) R gamma V
  W2 [V, r]: step k needs all of it (its input, x_{k-1}, is step k-1's sample), once per step
  for the whole batch -- gamma V r s; once in all when V r s fits in L2 (CPU shapes, say):  V r s
  W1[x_{k-1}] rows and hidden h_k:                 R gamma (r + d) s
  confidence weights (d + r + 1) s; keys in (anchor, T, seed, stream, round: 36 R);
  tokens, logprob, lse, conf out (20 R gamma).
FLOPs: 2 R gamma V r (the projection W2 e). Floor = max(bytes / copy, FLOPs / matmul).
Baseline, what plain torch does for the same job: per step e = W1[x], bias = e @ W2^T (cuBLAS),
z += bias, softmax(z / T), a sample by the exponential race argmax(p / E) (multinomial without
its host sync, so the loop is CUDA-graph capturable), logsumexp. Timed by CUDA-graph replay on
CUDA, as is the kernel; the reference eagerly. On CUDA each row also keeps plain_launch_us, the
kernel with DSPARK_CUDA_PDL=0 (no dependent launches between its per-step kernels).
"""
import os

import torch

from dspark_rt.testing.bench import (Report, backend_for, baseline_us, compiled_us, free, l2_bytes,
                                     median_us, parse_args, time_us)

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402
from dspark_rt.ops import reference  # noqa: E402

BASELINE = "cuBLAS e @ W2^T + torch softmax / exponential-race sample per step"


def shapes(cuda: bool, quick: bool):
    if cuda:
        V, r, d, grid = 151936, 256, 4096, [(R, g) for g in (7, 16) for R in (1, 32, 256)]
    else:  # quick: R=2 for R=8, the reference costs ~0.4 s per request and call here
        V, r, d, grid = 32000, 64, 256, [(1, 7), (2, 7) if quick else (8, 7)]
    return V, r, d, grid[:2] if quick else grid


def must_move(R, G, V, r, d, s, l2) -> int:
    w2_passes = G if V * r * s > l2 else 1
    s_u = 2 if s == 2 else 4  # U in the 16-bit weight dtype, else float32
    return (s_u + 4) * R * G * V + s * (w2_passes * V * r + R * G * (r + d) + d + r + 1) + 36 * R + 20 * R * G


def torch_baseline(logits, hidden, anchor, w1, w2, temperature):
    """Tokens [R, gamma] and lse of the same job in plain torch ops (sampled rows)."""
    R, G, V = logits.shape
    T = torch.where(temperature == 0, 1.0, temperature.float())[:, None]
    prev, toks, lse = anchor, [], []
    for k in range(G):
        z = logits[:, k]
        z += (w1[prev] @ w2.T).float()          # [R, r] x [r, V] on cuBLAS
        zt = z / T
        p = torch.softmax(zt, -1)
        prev = (p / torch.empty_like(p).exponential_()).argmax(-1)
        toks.append(prev)
        lse.append(torch.logsumexp(zt, -1))
    return torch.stack(toks, 1), torch.stack(lse, 1)


def measure(rep, args, dev, R, G, V, r, d, wdt, l2):
    """One shape's row (its GBs of inputs are freed on return)."""
    be = backend_for(dev)
    case = oc.MarkovCase(R, G, V, "vanilla", rank=r, d=d, conf="markov", temps="sampled")
    kw = oc.markov_inputs(case, dev, torch.float32, gen_device=dev)
    for k in ("hidden", "w1", "w2", "conf_w", "conf_b"):
        kw[k] = kw[k].to(wdt)
    U0 = kw.pop("logits")
    hidden, anchor, head = kw.pop("hidden"), kw.pop("anchor"), kw.pop("head")
    narrow = wdt != torch.float32  # a 16-bit model: its U as it is, z out of place
    U = U0.to(wdt) if narrow else U0
    logits = torch.empty_like(U0) if narrow else U0.clone()  # z
    call = lambda backend: ops.markov_sample(U if narrow else logits, hidden, anchor, head,
                                             backend=backend, out=logits, **kw)
    restore = (lambda: None) if narrow else (lambda: logits.copy_(U0))
    # Benchmarked inputs are checked inputs: the tokens must be the reference's.
    restore()
    ours = call(be)[0].clone()
    restore()
    match = float((ours == call("reference")[0]).double().mean())
    us, how = time_us(lambda: call(be), dev, setup=restore)
    ref_us = median_us(lambda: call("reference"), dev, setup=restore, warmup=1, runs=5) \
        if getattr(rep.args, "ref", "all") == "all" or not rep.rows else None  # --ref first: the smallest shape only
    # plain torch casts a 16-bit U to float32 first (the pass the kernel does without)
    base_us = baseline_us(lambda: torch_baseline(U.float() if narrow else logits, hidden, anchor,
                                                 kw["w1"], kw["w2"], kw["temperature"]),
                          dev, setup=restore)
    extra = {}
    if dev.type == "cuda":  # the per-step kernels launched plainly: what dependent launches save
        os.environ["DSPARK_CUDA_PDL"] = "0"
        try:
            extra["plain_launch_us"] = round(time_us(lambda: call(be), dev, setup=restore)[0], 1)
        finally:
            del os.environ["DSPARK_CUDA_PDL"]
    if args.compile:
        extra["compiled_ref_us"] = compiled_us(
            lambda: reference.markov_sample(logits.copy_(U) if narrow else logits, hidden, anchor,
                                            head, **kw), dev, setup=restore, runs=5)
    s = torch.finfo(wdt).bits // 8
    rep.add(f"R={R} gamma={G} V={V} r={r} weights={str(wdt)[6:]}", us, ref_us,
            must_move(R, G, V, r, d, s, l2), 2 * R * G * V * r, base_us=base_us, timed=how,
            tokens_match=match, **extra)
    if match < 1:
        print(f"  WARNING: {100 * (1 - match):.2f}% of tokens differ from the reference")


def run(args) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    weight_dtypes = [torch.bfloat16] if cuda else [torch.float32, torch.bfloat16][:1 if args.quick else 2]
    rep = Report("markov_sample", dev, weight_dtypes[0], args, baseline=BASELINE)
    V, r, d, grid = shapes(cuda, args.quick)
    for (R, G), wdt in ((g, w) for g in grid for w in weight_dtypes):
        measure(rep, args, dev, R, G, V, r, d, wdt, l2_bytes(dev))
        free(dev)
    return rep.finish()


def main(argv=None):
    run(parse_args(__doc__, argv))


if __name__ == "__main__":
    main()
