"""Row invariance (DESIGN §6): every op of the target's forward gives a token's row the same bits
whatever else shares the call — its chain's other rows (verify width, prefill chunk), other
requests, their order — in bfloat16, float16 and float32. Bitwise (torch.equal), never a
tolerance: a tolerance would pass the near-ties that flip a greedy token.

The ops run on their default CPU backend under exact mode (the default on the CPU). Seen failing:
with DSPARK_EXACT=0 (torch's GEMM) the float32 linear and model cases fail, and with
DSPARK_BACKEND=reference (the path bf16 attention took before the C++ kernel took 16-bit) the
attention cases fail in every dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from dspark_rt import ops
from dspark_rt.models.batch import AttnMeta
from dspark_rt.models.qwen3 import RMSNorm, apply_rope
from dspark_rt.testing.random_models import random_pair

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _splits(n, gen):
    """Random cut points of range(n) into consecutive pieces (at least one piece)."""
    cuts = sorted(set(torch.randint(1, max(n, 2), (3,), generator=gen).tolist()) - {n})
    return [0, *[c for c in cuts if 0 < c < n], n]


def _row_wise(fn, x, gen):
    """fn over all rows, over each row alone, over random consecutive pieces and over a random
    permutation (un-permuted): four results that must be bitwise equal."""
    n = x.shape[0]
    whole = fn(x)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(n)])
    cuts = _splits(n, gen)
    pieces = torch.cat([fn(x[a:b]) for a, b in zip(cuts, cuts[1:])])
    perm = torch.randperm(n, generator=gen)
    permuted = torch.empty_like(whole)
    permuted[perm] = fn(x[perm])
    return whole, alone, pieces, permuted


def _assert_all_equal(results, what):
    whole = results[0]
    for name, r in zip(("alone", "in pieces", "permuted"), results[1:]):
        diff = (r != whole) & ~(r.isnan() & whole.isnan())
        assert not diff.any(), f"{what}: rows computed {name} differ from all rows together " \
                               f"in {int(diff.any(-1).sum())} of {whole.shape[0]} rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(9, 64, 64), (37, 300, 129), (150, 96, 1000), (8, 1000, 17)])
def test_linear_rows(dtype, M, N, K):
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    _assert_all_equal(_row_wise(lambda t: ops.linear(t, w), x, gen), f"linear {M}x{N}x{K}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_and_norm_rows(dtype):
    """RMSNorm (reduction per row), rotary, SiLU * up, the residual add and the logits cast."""
    gen = torch.Generator().manual_seed(7)
    d, hd = 256, 32
    x = torch.randn(70, d, generator=gen).to(dtype)
    norm = RMSNorm(d, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    cos = torch.randn(70, hd, generator=gen).to(dtype)
    sin = torch.randn(70, hd, generator=gen).to(dtype)
    with torch.no_grad():
        _assert_all_equal(_row_wise(norm, x, gen), "RMSNorm")
        # rotary rows carry their own cos/sin: index them with the rows they go with
        idx = torch.arange(70)
        rope = lambda i: apply_rope(x[i].view(-1, d // hd, hd), cos[i], sin[i]).flatten(1)
        _assert_all_equal(_row_wise(rope, idx, gen), "rotary")
        _assert_all_equal(_row_wise(lambda t: F.silu(t) * (t + 1), x, gen), "SiLU * up")
        _assert_all_equal(_row_wise(lambda t: t + norm(t), x, gen), "residual add")
        _assert_all_equal(_row_wise(lambda t: t.to(torch.float32), x, gen), "logits cast")


def _attention(q, k_cache, v_cache, table, rows, kv_lens):
    """verify_attention over requests that all read one cache (table): request j is the chain of
    query rows `rows[j]` (consecutive positions) with kv_len kv_lens[j]."""
    qs = torch.cat([q[r] for r in rows])
    cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()],
                      dtype=torch.int32)
    tables = table.expand(len(rows), -1).contiguous()
    return ops.verify_attention(qs, cu, k_cache, v_cache, tables,
                                torch.tensor(kv_lens, dtype=torch.int32), causal=True,
                                scale=1.1 * q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ctx,n,h_q,h_kv,hd,ps", [(64, 8, 4, 2, 32, 16), (130, 8, 8, 2, 64, 16),
                                                  (200, 16, 4, 4, 24, 8), (0, 150, 2, 1, 64, 32),
                                                  (1, 7, 6, 3, 40, 4)])
def test_verify_attention_rows(dtype, ctx, n, h_q, h_kv, hd, ps):
    """A chain of n query rows at positions ctx .. ctx+n-1 over one request's cache: computed as
    one chain, row by row as chains of one (kv_len = position + 1), as random consecutive
    pieces, and beside other requests in shuffled order — bitwise equal."""
    gen = torch.Generator().manual_seed(ctx * 31 + n)
    L = ctx + n
    pages = (L + ps - 1) // ps
    perm = torch.randperm(pages + 2, generator=gen)[:pages].to(torch.int32)
    k_cache = torch.full((pages + 2, ps, h_kv, hd), math.nan).to(dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    k_cache[perm.long()] = torch.randn(pages, ps, h_kv, hd, generator=gen).to(dtype)
    v_cache[perm.long()] = torch.randn(pages, ps, h_kv, hd, generator=gen).to(dtype)
    table = perm[None]
    q = torch.randn(n, h_q, hd, generator=gen).to(dtype)
    pos = list(range(n))

    whole = _attention(q, k_cache, v_cache, table, [pos], [L])
    alone = torch.cat([_attention(q, k_cache, v_cache, table, [[i]], [ctx + i + 1]) for i in pos])
    cuts = _splits(n, gen)
    pieces = _attention(q, k_cache, v_cache, table, [pos[a:b] for a, b in zip(cuts, cuts[1:])],
                        [ctx + b for b in cuts[1:]])
    # the same pieces beside each other in shuffled order: other requests of other lengths
    order = torch.randperm(len(cuts) - 1, generator=gen).tolist()
    chunks = [pos[cuts[j]:cuts[j + 1]] for j in order]
    mixed = _attention(q, k_cache, v_cache, table, chunks, [ctx + c[-1] + 1 for c in chunks])
    unmixed = torch.empty_like(whole)
    at = 0
    for c in chunks:
        unmixed[c] = mixed[at:at + len(c)]
        at += len(c)
    _assert_all_equal((whole, alone, pieces, unmixed), f"verify_attention ctx={ctx} n={n}")


def _forward_logits(model, cache, ids, chunks, table):
    """Logits of every position of `ids` (one request), fed through the model's forward in the
    given consecutive chunks (a prefill chunk or a verify chain each)."""
    out = []
    ps = cache.page_size
    for a, b in zip(chunks, chunks[1:]):
        pos = torch.arange(a, b)
        meta = AttnMeta(cu_q=torch.tensor([0, b - a], dtype=torch.int32),
                        kv_lens=torch.tensor([b], dtype=torch.int32), block_tables=table,
                        slot_mapping=(table[0, pos // ps].long() * ps + pos % ps))
        logits, _ = model(ids[a:b], pos, meta, cache)
        out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_target_forward_rows(dtype):
    """The whole target forward (embedding, norms, rotary, every projection, attention, LM head,
    the float32 logits): one sequence fed as one prefill, one token per step (plain decoding),
    and in random chunks (chunked prefill, verify chains of varying width) gives the same
    logits bits at every position."""
    gen = torch.Generator().manual_seed(3)
    model = random_pair("tiny", dtype=dtype, device="cpu", seed=5)[0]
    n, ps = 40, 8
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
    cache = model.make_cache(num_pages=(n + ps - 1) // ps + 1, page_size=ps)
    table = torch.arange(cache.num_pages - 1, dtype=torch.int32)[None]
    whole = _forward_logits(model, cache, ids, [0, n], table)
    steps = _forward_logits(model, cache, ids, list(range(n + 1)), table)
    cuts = sorted({0, n, *torch.randint(1, n, (6,), generator=gen).tolist()})
    chunked = _forward_logits(model, cache, ids, cuts, table)
    for name, r in (("one token per step", steps), (f"in chunks {cuts}", chunked)):
        diff = (r != whole).any(-1)
        assert not diff.any(), f"{dtype}: logits fed {name} differ from one prefill at " \
                               f"positions {diff.nonzero().flatten().tolist()[:10]}"
