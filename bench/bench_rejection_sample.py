"""rejection_sample (lossless acceptance): C++/CUDA kernel vs the eager PyTorch reference and a
plain-torch baseline (softmax, gather, comparisons, one sample).

    python bench/bench_rejection_sample.py [--device cpu|cuda] [--json PATH] [--quick]

Shapes: CUDA (the goal shapes) R in {1, 32, 128, 256}, gamma=7, V=151936; CPU (scaled down)
R in {1, 8, 32} (--quick: 1, 2), gamma=7, V=32000. float32 logits, every request verifies gamma drafts drawn
from q close to P (long acceptances), sampled rows. Plus bf16 target logits under float32 drafts
(a bf16 model's verify output as the runtime serves it) at R = 32 and 128 on CUDA, R = 8 on the
CPU; their target rows count 2 bytes an element, and the baseline widens them first as a torch
user must.

Bytes the op must move, from the acceptances a_r this run produced (l_r = gamma drafts checked):
  target rows 0..a_r (each accept test needs P_{k-1}, a softmax over the whole row; row a_r
  gives the residual or the bonus sample):                      b V (a_r + 1), b = 4 or 2 (bf16)
  one draft row where a draft was rejected (the residual max(0, P - q) needs all of q):
                                                                4 V [a_r < l_r]
  per tested draft k <= min(a_r + 1, l_r): q_k(x_k) = exp(z_k[x_k] / T - lse_k), one logit,
  lse and token (16 B) -- draft rows past the first rejection are never needed;
  cu_rows, T, seed, stream, round (32 R + 4), outputs (4 R + 8 R (gamma + 1)).
FLOPs: none counted (exp-bound). A kernel that reads every row in one pass moves up to
(2 gamma + 1) / (a + 2) times this.
Baseline, plain torch for the same job (full chains: target viewed [R, gamma + 1, V]):
softmax of every target row, gathers of P(x) and q(x), accept = cumprod(u q < P), the residual
row at the first rejection and a sample of it by the exponential race. Timed by CUDA-graph
replay on CUDA, as is the kernel; the reference eagerly.
"""
import torch
import torch.nn.functional as F

from dspark_rt.testing.bench import Report, backend_for, baseline_us, free, median_us, parse_args, time_us

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402

BASELINE = "torch softmax + gather + cumprod(u q < P) + residual sample"


def must_move(acc, cu_rows, V, target_bytes=4) -> int:
    ell = (cu_rows[1:] - cu_rows[:-1] - 1).long().cpu()
    a = acc.long().cpu()
    R, gamma = a.numel(), int(ell.max()) if a.numel() else 0
    rows = int((a + 1).sum()) + int((a < ell).sum())
    tested = int(torch.minimum(a + 1, ell).sum())
    target_rows = int((a + 1).sum())
    return (target_bytes * V * target_rows + 4 * V * (rows - target_rows) + 16 * tested + 32 * R + 4
            + 4 * R + 8 * R * (gamma + 1))


def torch_baseline(target, draft_logits, draft_lse, tokens, temperature):
    """(num_accepted [R], out_tokens [R, gamma + 1]) of full chains in plain torch ops."""
    R, G, V = draft_logits.shape
    T = temperature.float().clamp_min(1e-6)
    P = torch.softmax(target.float().view(R, G + 1, V) / T[:, None, None], -1)
    px = P[:, :G].gather(2, tokens[..., None])[..., 0]
    qx = torch.exp(draft_logits.gather(2, tokens[..., None])[..., 0] / T[:, None] - draft_lse)
    n = (torch.rand_like(px) * qx < px).int().cumprod(1).sum(1)          # accepted drafts
    j = n.clamp(max=G - 1).long()
    row = P.gather(1, n.long().view(R, 1, 1).expand(R, 1, V))[:, 0]
    q = torch.exp(draft_logits.gather(1, j.view(R, 1, 1).expand(R, 1, V))[:, 0] / T[:, None]
                  - draft_lse.gather(1, j[:, None]))
    res = (row - q * (n < G)[:, None]).clamp_min(0)
    y = (res / torch.empty_like(res).exponential_()).argmax(1)
    pos = torch.arange(G + 1, device=n.device)
    out = torch.where(pos < n[:, None], F.pad(tokens, (0, 1)), -1)
    return n, out.scatter_(1, n.long()[:, None], y[:, None])


def measure(rep, dev, R, G, V, target_dtype=torch.float32):
    """One shape's row (its GBs of inputs are freed on return)."""
    be = backend_for(dev)
    case = oc.RejectionCase(R, G, V, "full", "sampled", "likely")
    kw = oc.rejection_inputs(case, dev, torch.float32, gen_device=dev)
    kw["target_logits"] = kw["target_logits"].to(target_dtype)
    args_ = [kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
    call = lambda backend: ops.rejection_sample(*args_, backend=backend, **kw)
    acc, out, _ = call(be)
    racc, rout, _ = call("reference")
    match = bool(torch.equal(acc, racc) and torch.equal(out, rout))
    us, how = time_us(lambda: call(be), dev)
    ref_us = median_us(lambda: call("reference"), dev, warmup=1, runs=5) \
        if getattr(rep.args, "ref", "all") == "all" or not rep.rows else None  # --ref first: the smallest shape only
    target, cu_rows, tokens, draft, lse = args_
    base = lambda: torch_baseline(target, draft, lse, tokens, kw["temperature"])
    base_us = baseline_us(base, dev)
    base_acc = float(base()[0].float().mean()) if base_us else None
    name = f"R={R} gamma={G} V={V}" + ("" if target_dtype == torch.float32 else " target bf16")
    rep.add(name, us, ref_us, must_move(acc, cu_rows, V, target.element_size()), 0.0,
            base_us=base_us, timed=how, outputs_match=match, mean_accepted=float(acc.float().mean()),
            baseline_mean_accepted=base_acc)
    if not match:
        print("  WARNING: outputs differ from the reference")


def run(args) -> dict:
    dev = torch.device(args.device)
    rep = Report("rejection_sample", dev, torch.float32, args, baseline=BASELINE)
    bf16 = torch.bfloat16
    if dev.type == "cuda":
        grid = [(R, 7, 151936, torch.float32) for R in (1, 32, 128, 256)]
        grid += [(R, 7, 151936, bf16) for R in (32, 128)]
    else:  # quick: R=2 for R=8, the reference loops over requests in Python
        grid = [(1, 7, 32000, torch.float32), (2 if args.quick else 8, 7, 32000, torch.float32),
                (32, 7, 32000, torch.float32), (2 if args.quick else 8, 7, 32000, bf16)]
    for R, G, V, dt in [grid[0], grid[1], grid[-1]] if args.quick else grid:
        measure(rep, dev, R, G, V, dt)
        free(dev)
    return rep.finish()


def main(argv=None):
    run(parse_args(__doc__, argv))


if __name__ == "__main__":
    main()
