"""verify_attention (ragged paged attention of verify chains): kernel vs the eager reference,
torch SDPA and FlexAttention over the paged cache.

    python bench/bench_verify_attention.py [--device cpu|cuda] [--json PATH] [--quick]
                                           [--flex none|one|all]

Shapes: CUDA 32 query / 8 KV heads, head_dim 128, bf16; the goal shapes context 4k, R in
{1, 8, 32, 128, 256}, then context 1k at R=32 and 32k at R in {1, 32}. CPU (scaled down) 8 / 2
heads, head_dim 64, float32, context 256/1024, R in {1, 8}. Chains of n=8 queries, causal,
page size 16, permuted block tables.
Bytes the op must move: each request's L = ctx + n keys and values once (2 L h_kv head_dim s),
q read and out written (2 n h_q head_dim s), its ceil(L / 16) block-table entries and kv_len,
cu_q (12 B). FLOPs: 4 h_q head_dim per (query, visible key).
The timed call is one layer's as a model forward makes it: with the forward's plan
(ops.plan_verify_attention, made once per forward; its own time is plan_us) and an out= buffer,
by CUDA-graph replay on CUDA. unplanned_us: the same call planning (and, on CUDA, allocating its
scratch) by itself, eagerly.
Baselines, timed like the kernel: torch SDPA (scaled_dot_product_attention, GQA, lower-right
causal mask) over K/V already gathered into dense [R, h_kv, L, head_dim] tensors -- the gather
is NOT timed, so SDPA moves the same bytes as the kernel and is an optimistic baseline;
flex_us: FlexAttention (compiled, CUDA only) over the paged cache itself, one sequence of every
page with a block mask built from the block tables (owner and logical position of each page);
128-wide blocks over permuted 16-slot pages make it read most pages once per query block.
Compilation costs tens of seconds per shape: --flex one (the CUDA default) times it at R=32
ctx 4k only, all at every shape, none never.
"""
import argparse
import math

import torch
import torch.nn.functional as F

from dspark_rt.testing.bench import (Report, add_args, backend_for, baseline_us, free, median_us, time_us,
                                     why)

from dspark_rt.testing import op_cases as oc  # benchmarked inputs are tested inputs
from dspark_rt import ops  # noqa: E402

BASELINE = "torch SDPA, dense K/V gathered outside the timing (optimistic)"


def must_move(R, ctx, n, h_q, h_kv, hd, s, ps=16) -> int:
    L = ctx + n
    return R * (2 * L * h_kv * hd * s + 2 * n * h_q * hd * s + 4 * math.ceil(L / ps) + 12)


def dense_kv(cache, block_tables, L):
    """[R, h_kv, L, head_dim] of every request's keys (or values) in order: SDPA's input."""
    P, ps = math.ceil(L / cache.shape[1]), cache.shape[1]
    pages = block_tables[:, :P].long()
    R, h_kv, hd = pages.shape[0], cache.shape[2], cache.shape[3]
    return cache[pages].reshape(R, P * ps, h_kv, hd)[:, :L].transpose(1, 2).contiguous()


def sdpa_baseline(q, k_cache, v_cache, block_tables, R, n, L, scale, explicit_mask=False):
    """SDPA on dense copies; the causal mask as torch's lower-right bias (lets SDPA pick a fused
    kernel) or, explicit_mask, as a [n, L] bool tensor."""
    h_q, hd = q.shape[1], q.shape[2]
    qd = q.view(R, n, h_q, hd).transpose(1, 2).contiguous()
    k, v = dense_kv(k_cache, block_tables, L), dense_kv(v_cache, block_tables, L)
    if explicit_mask:
        pos = torch.arange(L, device=q.device)
        mask = pos[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(n, L)
    fn = lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return fn, lambda o: o.transpose(1, 2).reshape(R * n, h_q, hd)


def flex_paged(q, k_cache, v_cache, block_tables, kv_lens, R, n, scale, compile_=True):
    """FlexAttention over the whole paged cache as one sequence of num_pages * page_size slots:
    query i of request r sees slot t iff t's page belongs to r and t's logical position
    (page index in r's table * page_size + t % page_size) <= kv_len - n + i."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    num_pages, ps, h_kv, hd = k_cache.shape
    dev, h_q = q.device, q.shape[1]
    owner = torch.full((num_pages,), -1, dtype=torch.int64, device=dev)
    logical = torch.zeros(num_pages, dtype=torch.int64, device=dev)
    for r in range(R):
        used = block_tables[r, :math.ceil(int(kv_lens[r]) / ps)].long()
        owner[used] = r
        logical[used] = torch.arange(used.numel(), device=dev)
    q_req = torch.arange(R, device=dev).repeat_interleave(n)
    q_pos = kv_lens.long()[q_req] - n + torch.arange(R * n, device=dev) % n

    def mask_mod(b, h, qi, ki):
        page = ki // ps
        return (owner[page] == q_req[qi]) & (logical[page] * ps + ki % ps <= q_pos[qi])

    S = num_pages * ps
    bm = create_block_mask(mask_mod, 1, None, R * n, S, device=dev)
    Q = q.view(1, R * n, h_q, hd).transpose(1, 2)
    K = k_cache.view(1, S, h_kv, hd).transpose(1, 2)
    V = torch.nan_to_num(v_cache).view(1, S, h_kv, hd).transpose(1, 2)  # 0 * NaN would leak
    attend = torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention
    fn = lambda: attend(Q, K, V, block_mask=bm, scale=scale, enable_gqa=True)
    return fn, lambda o: o.transpose(1, 2).reshape(R * n, h_q, hd)


def inputs(R, ctx, n, h_q, h_kv, hd, dev, dtype):
    case = oc.AttentionCase((n,) * R, (ctx,) * R, h_q, h_kv, hd, 16, extra_pages=0)
    kw = oc.attention_inputs(case, dev, dtype, gen_device=dev)
    return [kw.pop(k) for k in ("q", "cu_q", "k_cache", "v_cache", "block_tables", "kv_lens")], kw


def time_flex(rep, row, R, ctx, n, h_q, h_kv, hd, dev, dtype):
    """Adds flex_us to a measured row (fresh inputs of the same shape); its compilation runs
    after every other shape so that it cannot cost them their time."""
    args_, kw = inputs(R, ctx, n, h_q, h_kv, hd, dev, dtype)
    q, _, k_cache, v_cache, bt, kv_lens = args_
    try:
        want = ops.verify_attention(*args_, backend="reference", **kw).float()
        fn, unpack = flex_paged(q, k_cache, v_cache, bt, kv_lens, R, n, kw["scale"])
        row["flex_max_abs_err"] = float((unpack(fn()).float() - want).abs().max())
        row["flex_us"] = round(time_us(fn, dev)[0], 1)
        row["ratio_vs_flex"] = row["flex_us"] / row["us"]
        print(f"{row['shape']:<44}FlexAttention over the paged cache: {row['flex_us']} us "
              f"(kernel {row['ratio_vs_flex']:.2f}x faster), max abs err {row['flex_max_abs_err']:.3g}")
    except Exception as e:  # a torch without it, or a compile failure: say so, go on
        row["flex_us"] = None
        print(f"  FlexAttention failed at {row['shape']}: {why(e)}")
    if getattr(rep.args, "on_row", None):
        rep.args.on_row(rep)


def measure(rep, dev, dtype, R, ctx, n, h_q, h_kv, hd) -> dict:
    """One shape's row (its GBs of caches are freed on return)."""
    be = backend_for(dev)
    args_, kw = inputs(R, ctx, n, h_q, h_kv, hd, dev, dtype)
    call = lambda backend: ops.verify_attention(*args_, backend=backend, **kw)
    q, cu_q, k_cache, v_cache, bt, kv_lens = args_
    make_plan = lambda: ops.plan_verify_attention(cu_q, kv_lens, bt, k_cache, h_q=h_q,
                                                  causal=kw["causal"], backend=be)
    plan, out = make_plan(), torch.empty_like(q)
    planned = lambda: ops.verify_attention(*args_, plan=plan, out=out, **kw)
    want = call("reference").float()
    err = float((planned().float() - want).abs().max())
    us, how = time_us(planned, dev)
    unplanned_us = median_us(lambda: call(be), dev)
    plan_us = median_us(make_plan, dev)
    ref_us = median_us(lambda: call("reference"), dev, warmup=1, runs=5) \
        if getattr(rep.args, "ref", "all") == "all" or not rep.rows else None  # --ref first: the smallest shape only
    L, extra, base_us = ctx + n, {}, None
    for explicit in (False, True):
        try:
            fn, unpack = sdpa_baseline(q, k_cache, v_cache, bt, R, n, L, kw["scale"], explicit)
            extra["sdpa_max_abs_err"] = float((unpack(fn()).float() - want).abs().max())
            extra["sdpa_mask"] = "explicit bool" if explicit else "causal_lower_right"
            base_us = baseline_us(fn, dev)
            break
        except Exception as e:  # this torch's SDPA refuses the bias: the plain mask next
            print(f"  SDPA ({'explicit' if explicit else 'lower-right bias'}) failed: {why(e)}")
    flops = R * sum(4 * h_q * hd * (L - n + i + 1) for i in range(n))
    s = torch.finfo(dtype).bits // 8
    return rep.add(f"R={R} ctx={ctx} h={h_q}/{h_kv} hd={hd}", us, ref_us,
                   must_move(R, ctx, n, h_q, h_kv, hd, s), flops, base_us=base_us, timed=how,
                   max_abs_err_vs_ref=err, unplanned_us=round(unplanned_us, 1),
                   plan_us=round(plan_us, 1), **extra)


def run(args) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rep = Report("verify_attention", dev, dtype, args, baseline=BASELINE)
    flex = getattr(args, "flex", None) or ("one" if cuda else "none")
    if cuda:
        h_q, h_kv, hd = 32, 8, 128
        grid = [(R, 4096) for R in (1, 8, 32, 128, 256)] + [(32, 1024), (1, 32768), (32, 32768)]
    else:
        h_q, h_kv, hd, grid = 8, 2, 64, [(R, c) for c in (256, 1024) for R in (1, 8)]
        if flex != "none":
            print("  flex: not timed on the CPU (compiled FlexAttention is timed on CUDA only)")
            flex = "none"
    n, flex_rows = 8, []
    for R, ctx in grid[:2] if args.quick else grid:
        row = measure(rep, dev, dtype, R, ctx, n, h_q, h_kv, hd)
        if flex == "all" or (flex == "one" and (R, ctx) == (32, 4096)):
            flex_rows.append((row, R, ctx))
        free(dev)
    for row, R, ctx in flex_rows:  # last: compiling must not cost the other shapes their time
        time_flex(rep, row, R, ctx, n, h_q, h_kv, hd, dev, dtype)
        free(dev)
    return rep.finish()


def add_flex_arg(ap):
    ap.add_argument("--flex", choices=["none", "one", "all"],
                    help="FlexAttention baseline shapes (CUDA; default one: R=32 ctx 4k)")
    return ap


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run(add_flex_arg(add_args(ap)).parse_args(argv))


if __name__ == "__main__":
    main()
