"""verify_attention (ragged paged attention of verify chains): kernel vs the eager reference.

    python bench/bench_verify_attention.py [--device cpu|cuda] [--json PATH] [--quick]

Shapes: CUDA 32 query / 8 KV heads, head_dim 128, bf16, context 1k/4k/32k, R in {1, 32, 128};
CPU (scaled down) 8 / 2 heads, head_dim 64, float32, context 256/1024, R in {1, 8}. Chains of 8
queries, causal, page size 16, permuted block tables. Bytes: each request's K and V read once
plus q and out. FLOPs: 4 h_q head_dim per (query, visible key).
The timed call is one layer's as a model forward makes it: with the forward's plan
(ops.plan_verify_attention, made once per forward; its own time is plan_us) and an out= buffer.
unplanned_us: the same call planning (and, on CUDA, allocating its scratch) by itself.
"""
import torch

from dspark_rt.testing.bench import Report, backend_for, median_us, parse_args

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402


def main():
    args = parse_args(__doc__)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    be = backend_for(dev)
    rep = Report("verify_attention", dev, dtype, args)
    if cuda:
        h_q, h_kv, hd, grid = 32, 8, 128, [(R, c) for c in (1024, 4096, 32768) for R in (1, 32, 128)]
    else:
        h_q, h_kv, hd, grid = 8, 2, 64, [(R, c) for c in (256, 1024) for R in (1, 8)]
    n, s = 8, torch.finfo(dtype).bits // 8
    for R, ctx in grid[:2] if args.quick else grid:
        case = oc.AttentionCase((n,) * R, (ctx,) * R, h_q, h_kv, hd, 16, extra_pages=0)
        kw = oc.attention_inputs(case, dev, dtype, gen_device=dev)
        args_ = [kw.pop(k) for k in ("q", "cu_q", "k_cache", "v_cache", "block_tables", "kv_lens")]
        run = lambda backend: ops.verify_attention(*args_, backend=backend, **kw)
        q, cu_q, k_cache, _, bt, kv_lens = args_
        make_plan = lambda: ops.plan_verify_attention(cu_q, kv_lens, bt, k_cache, h_q=h_q,
                                                      causal=kw["causal"], backend=be)
        plan, out = make_plan(), torch.empty_like(q)
        planned = lambda: ops.verify_attention(*args_, plan=plan, out=out, **kw)
        err = float((planned().float() - run("reference").float()).abs().max())
        us = median_us(planned, dev)
        unplanned_us = median_us(lambda: run(be), dev)
        plan_us = median_us(make_plan, dev)
        ref_us = median_us(lambda: run("reference"), dev, warmup=1, runs=5)
        L = ctx + n
        nbytes = R * (2 * L * h_kv * hd * s + 2 * n * h_q * hd * s + 4 * (L // 16 + 1))
        flops = R * sum(4 * h_q * hd * (L - n + i + 1) for i in range(n))
        rep.add(f"R={R} ctx={ctx} h={h_q}/{h_kv} hd={hd}", us, ref_us, nbytes, flops,
                max_abs_err_vs_ref=err, unplanned_us=round(unplanned_us, 1), plan_us=round(plan_us, 1))
    rep.finish()


if __name__ == "__main__":
    main()
