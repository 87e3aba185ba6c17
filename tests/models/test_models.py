"""The Qwen3 / Llama target against transformers, the drafter against a dense re-implementation,
and the paged KV cache / page allocator.

Every forward runs incrementally through a paged cache (page_size 4, permuted block tables,
NaN-poisoned so a read of a slot nobody wrote shows up) and is compared with one full,
cache-free forward of the reference.
"""
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from dspark_rt import testing
from dspark_rt.models.kv_cache import KVCacheError, PagedKVCache
from dspark_rt.models.batch import AttnMeta
from dspark_rt.models.drafter import Drafter
from dspark_rt.models.qwen3 import Qwen3Model, rope_inv_freq

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers only ever reads the tiny local dirs

PAGE = 4
SIZES = dict(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
TARGET_CASES = {
    "qwen3": dict(arch="qwen3", head_dim=32),
    "qwen3-tied-mqa": dict(arch="qwen3", tie=True, kv_heads=1, head_dim=16),
    "llama": dict(arch="llama"),
    "llama-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-llama3": dict(arch="llama", rope_scaling=LLAMA3, rope_theta=500.0),
}


# -- paged batches ---------------------------------------------------------------------------
class Pages:
    """R requests over a NaN-poisoned cache whose pages are handed out in a random order."""

    def __init__(self, R, max_pages, seed):
        g = torch.Generator().manual_seed(seed)
        self.num_pages = R * max_pages + 3  # spare pages nobody owns stay NaN
        perm = torch.randperm(self.num_pages, generator=g)
        self.block_tables = perm[: R * max_pages].view(R, max_pages).to(torch.int32)
        self.lens = [0] * R

    def step(self, counts, causal):
        """Meta for appending counts[r] tokens to request r; returns (meta, positions)."""
        pos, slots = [], []
        for r, n in enumerate(counts):
            p = torch.arange(self.lens[r], self.lens[r] + n)
            pos.append(p)
            slots.append(self.block_tables[r, p // PAGE].long() * PAGE + p % PAGE)
            self.lens[r] += n
        cu = torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32)
        meta = AttnMeta(cu_q=cu, kv_lens=torch.tensor(self.lens, dtype=torch.int32),
                        block_tables=self.block_tables, slot_mapping=torch.cat(slots),
                        causal=causal)
        return meta, torch.cat(pos)


# -- transformers in float64 ------------------------------------------------------------------
def _inv_freq64(cfg):
    """Inverse rotary frequencies in float64 from a transformers config (default/linear/llama3)."""
    rp = cfg.rope_parameters
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    kind = rp.get("rope_type", "default")
    if kind == "linear":
        return inv / rp["factor"]
    if kind == "llama3":
        f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        out = []
        for w in inv.tolist():
            wl = 2 * math.pi / w
            if wl < old / hi:
                out.append(w)
            elif wl > old / lo:
                out.append(w / f)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * w / f + s * w)
        return torch.tensor(out, dtype=torch.float64)
    return inv


def _rmsnorm64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    freqs = position_ids[..., None].to(torch.float64) * _inv_freq64(self.config)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@pytest.fixture
def hf_float64(monkeypatch):
    """transformers' RMSNorm and rotary tables round through float32 by design (they serve
    half-precision models), which caps float64 agreement at ~1e-7. Swap in the same formulas
    without that round trip, so the comparison below tests the math, not float32 rounding."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.qwen3 import modeling_qwen3 as mq
    for mod, pre in ((mq, "Qwen3"), (ml, "Llama")):
        monkeypatch.setattr(getattr(mod, f"{pre}RMSNorm"), "forward", _rmsnorm64)
        monkeypatch.setattr(getattr(mod, f"{pre}RotaryEmbedding"), "forward", _rotary64)


@pytest.fixture
def reference_attention(monkeypatch):
    """float64 comparisons pin the op's PyTorch reference: the C++ kernel takes its scale as a
    float32 (VerifyAttentionParams.scale), which costs ~1e-8 in float64. The float32 cases run
    whatever backend the door picks."""
    monkeypatch.setenv("DSPARK_BACKEND", "reference")


def _hf_model(path, arch, dtype):
    import transformers
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    return cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def _hf_full(hf, seqs):
    """Per request: logits [len, V] and hidden_states (L + 1 tensors [len, d])."""
    out = []
    with torch.no_grad():
        for s in seqs:
            o = hf(input_ids=torch.tensor([s]), output_hidden_states=True)
            out.append((o.logits[0], [h[0] for h in o.hidden_states]))
    return out


def _incremental(model, seqs, plan, capture):
    """Feeds seqs through model step by step (plan: per step, tokens per request) and returns,
    per request, {position: (logits row, feature row)}."""
    R = len(seqs)
    pages = Pages(R, max_pages=max(math.ceil(len(s) / PAGE) for s in seqs), seed=3)
    cache = model.make_cache(pages.num_pages, PAGE)
    cache.fill_(float("nan"))
    got = [dict() for _ in range(R)]
    for step, counts in enumerate(plan):
        starts = list(pages.lens)
        meta, pos = pages.step(counts, causal=True)
        ids = torch.cat([torch.tensor(seqs[r][starts[r]: starts[r] + n], dtype=torch.int64)
                         for r, n in enumerate(counts)])
        N = ids.shape[0]
        rows = torch.arange(N).flip(0) if step % 2 else None  # also exercise logits_rows
        logits, feats = model(ids, pos, meta, cache, capture_layers=capture, logits_rows=rows)
        if rows is not None:
            logits = logits.flip(0)
        assert logits.shape == (N, model.config.vocab_size) and feats.shape[0] == N
        i = 0
        for r, n in enumerate(counts):
            for j in range(n):
                got[r][starts[r] + j] = (logits[i], feats[i])
                i += 1
    return got


def _close(a, b, rel):
    err = (a - b).abs().max().item() / b.abs().max().item()
    assert err <= rel, f"relative error {err:.3g} > {rel:.1g}"


@pytest.mark.parametrize("case", list(TARGET_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_target_matches_transformers(tmp_path, case, dtype, request):
    kw = {**SIZES, **TARGET_CASES[case]}
    path = testing.write_tiny_target(tmp_path / "t", seed=11, **kw)
    if dtype == torch.float64:
        request.getfixturevalue("hf_float64")
        request.getfixturevalue("reference_attention")
    ours = Qwen3Model.from_pretrained(path, dtype=dtype)
    hf = _hf_model(path, kw["arch"], dtype)
    g = torch.Generator().manual_seed(5)
    # prompts of 4 (a full page), 1 and 9 (one past two pages) tokens; then 3 decode steps; then
    # causal chains of 3, 0 (empty) and 4 tokens, as a verify step sends them
    prompts = [4, 1, 9]
    plan = [prompts, [1, 1, 1], [1, 1, 1], [1, 1, 1], [3, 0, 4]]
    totals = [sum(p[r] for p in plan) for r in range(3)]
    seqs = [torch.randint(0, kw["vocab"], (n,), generator=g).tolist() for n in totals]
    L = kw["layers"]
    capture = [1, -1, 0]  # any order; the final layer (L - 1) is what the drafter never takes
    got = _incremental(ours, seqs, plan, capture)
    ref = _hf_full(hf, seqs)
    # float64: both sides evaluate the same formulas in float64 (unit roundoff 1.1e-16) and
    # differ only in summation order (matmul blocking, SDPA vs the op's einsum). Through L=3
    # layers of dot products of length <= 128 that stays ~1e-13 relative; 1e-10 keeps a 1000x
    # margin while float32-rounded rope / norms (>= 1e-8) or a wrong slot (O(1)) fail.
    # float32 vs unpatched transformers: same, at float32 roundoff (6e-8) times the same growth.
    rel = 1e-10 if dtype == torch.float64 else 2e-5
    for r in range(3):
        lg = torch.stack([got[r][p][0] for p in range(totals[r])])
        ft = torch.stack([got[r][p][1] for p in range(totals[r])])
        assert lg.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert ft.dtype == dtype and ft.shape[1] == len(capture) * kw["hidden"]
        _close(lg, ref[r][0].to(lg.dtype), rel)
        want = torch.cat([ref[r][1][l + 1] for l in capture], dim=-1)
        _close(ft, want, rel)
        assert ref[r][1][0].shape[0] == totals[r] and L + 1 == len(ref[r][1])


def test_rope_inv_freq_bitwise_as_transformers(tmp_path):
    """In float32 our inverse frequencies are transformers' to the bit (same formula, same order)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from dspark_rt.checkpoint.config import TargetConfig
    for case in ("llama-linear", "llama-llama3"):
        path = testing.write_tiny_target(tmp_path / case, **{**SIZES, **TARGET_CASES[case]})
        hf_cfg = AutoConfig.from_pretrained(path)
        want, _ = ROPE_INIT_FUNCTIONS[hf_cfg.rope_parameters["rope_type"]](hf_cfg, "cpu")
        ours = rope_inv_freq(TargetConfig.from_json(path), torch.float32)
        assert torch.equal(ours, want)


def test_capture_layers_range(tmp_path):
    path = testing.write_tiny_target(tmp_path / "t", **SIZES)
    m = Qwen3Model.from_pretrained(path)
    pages = Pages(1, 2, seed=0)
    meta, pos = pages.step([2], causal=True)
    cache = m.make_cache(pages.num_pages, PAGE)
    with pytest.raises(ValueError, match="capture_layers"):
        m(torch.tensor([1, 2]), pos, meta, cache, capture_layers=[SIZES["layers"]])
    logits, feats = m(torch.tensor([1, 2]), pos, meta, cache, logits_rows=torch.tensor([1]))
    assert logits.shape == (1, SIZES["vocab"]) and feats is None


# -- drafter ------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _dense_block(w, emb, c, feats, block_ids, ctx_pos, block_pos):
    """The drafter of DESIGN §2 written densely for one request, straight from the file's weights:
    K/V = [context; block], block queries see all of it (no mask), plain softmax."""
    d, hq, hkv, eps, theta = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["rms_norm_eps"], c["rope_theta"]
    hd = c["head_dim"]
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = emb[block_ids]
    for i in range(c["num_hidden_layers"]):
        p = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        x = _rms(h, p("input_layernorm.weight"), eps)
        q = _rope(_rms((x @ p("self_attn.q_proj.weight").T).view(-1, hq, hd), p("self_attn.q_norm.weight"), eps), block_pos, theta)

        def kv(src, pos):
            k = _rms((src @ p("self_attn.k_proj.weight").T).view(-1, hkv, hd), p("self_attn.k_norm.weight"), eps)
            return _rope(k, pos, theta), (src @ p("self_attn.v_proj.weight").T).view(-1, hkv, hd)
        kc, vc = kv(ctx, ctx_pos)
        kb, vb = kv(x, block_pos)
        K = torch.cat([kc, kb]).repeat_interleave(hq // hkv, dim=1)
        V = torch.cat([vc, vb]).repeat_interleave(hq // hkv, dim=1)
        a = torch.softmax(torch.einsum("qhd,khd->hqk", q, K) * hd ** -0.5, dim=-1)
        h = h + torch.einsum("hqk,khd->qhd", a, V).reshape(len(h), hq * hd) @ p("self_attn.o_proj.weight").T
        x = _rms(h, p("post_attention_layernorm.weight"), eps)
        act = torch.nn.functional.silu(x @ p("mlp.gate_proj.weight").T) * (x @ p("mlp.up_proj.weight").T)
        h = h + act @ p("mlp.down_proj.weight").T
    return _rms(h, w["norm.weight"], eps)


@pytest.mark.parametrize("fmt", ["deepspec", "zlab"])
def test_drafter_block_matches_dense(tmp_path, fmt, reference_attention):
    import json
    tdir = testing.write_tiny_target(tmp_path / "t", seed=2, **{**SIZES, "head_dim": 32})
    ddir = tmp_path / "d"
    common = dict(layers=2, block_size=5, target_layer_ids=[-1, 1], seed=4)
    if fmt == "zlab":
        testing.write_tiny_dflash(ddir, tdir, **common)
    else:
        testing.write_tiny_drafter(ddir, tdir, head="gated", markov_rank=8, **common)
    target = Qwen3Model.from_pretrained(tdir, dtype=torch.float64)
    dr = Drafter.from_pretrained(ddir, target)
    assert dr.dtype == torch.float64 and dr.layout == ("anchor_first" if fmt == "deepspec" else "one_plus_n")
    c = json.loads((ddir / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(ddir / "model.safetensors").items()}
    emb = load_file(tdir / "model.safetensors")["model.embed_tokens.weight"].double()
    B, m, d = 5, 2, SIZES["hidden"]
    ctx_lens = [6, 3, 1]
    g = torch.Generator().manual_seed(9)
    feats = [torch.randn(n, m * d, generator=g, dtype=torch.float64) for n in ctx_lens]
    pages = Pages(3, max_pages=math.ceil((max(ctx_lens) + B) / PAGE), seed=8)
    cache = dr.make_cache(pages.num_pages, PAGE)
    cache.fill_(float("nan"))
    # context in two rounds (6 = 4 + 2, the others at once), as the runtime appends commits
    for chunk in ([4, 3, 1], [2, 0, 0]):
        starts = list(pages.lens)
        meta, pos = pages.step(chunk, causal=False)
        f = torch.cat([feats[r][starts[r]: starts[r] + n] for r, n in enumerate(chunk)])
        dr.context_update(f, pos, meta.slot_mapping, cache)
    x0 = torch.randint(0, SIZES["vocab"], (3,), generator=g)
    ids = torch.full((3, B), dr.mask_token_id)
    ids[:, 0] = x0
    meta, pos = pages.step([B] * 3, causal=False)
    hidden = dr.forward_block(ids.reshape(-1), pos, meta, cache)
    assert hidden.shape == (3 * B, d)
    for r, n in enumerate(ctx_lens):
        want = _dense_block(w, emb, c, feats[r], ids[r], torch.arange(n), torch.arange(n, n + B))
        _close(hidden[r * B:(r + 1) * B], want, 1e-10)  # float64 on both sides, as for the target
    assert torch.equal(dr.logits(hidden), target.lm_head(hidden))
    with pytest.raises(ValueError, match="causal"):
        dr.forward_block(ids.reshape(-1), pos, AttnMeta(meta.cu_q, meta.kv_lens, meta.block_tables,
                                                        meta.slot_mapping, True), cache)


def _count_plans(monkeypatch):
    """Counts ops.plan_verify_attention calls, and verify_attention calls by the plan they got."""
    from dspark_rt import ops
    made, used = [], []
    plan, verify = ops.plan_verify_attention, ops.verify_attention
    monkeypatch.setattr(ops, "plan_verify_attention", lambda *a, **k: made.append(plan(*a, **k)) or made[-1])
    monkeypatch.setattr(ops, "verify_attention", lambda *a, **k: used.append(k.get("plan")) or verify(*a, **k))
    return made, used


def test_attention_planned_once_per_forward(tmp_path, monkeypatch):
    """Target and drafter forwards plan verify_attention once and hand that plan to every layer
    (FlashInfer's plan/run), through the public model API."""
    tdir = testing.write_tiny_target(tmp_path / "t", seed=2, **{**SIZES, "head_dim": 32})
    testing.write_tiny_drafter(tmp_path / "d", tdir, head="vanilla", markov_rank=8, layers=2,
                               block_size=4, target_layer_ids=[0, 1], seed=4)
    target = Qwen3Model.from_pretrained(tdir)
    dr = Drafter.from_pretrained(tmp_path / "d", target)
    made, used = _count_plans(monkeypatch)
    pages = Pages(2, max_pages=4, seed=1)
    cache = target.make_cache(pages.num_pages, PAGE)
    for counts in ([3, 5], [1, 2]):  # prefill, then a verify-like step
        meta, pos = pages.step(counts, causal=True)
        made.clear(), used.clear()
        target(torch.randint(0, SIZES["vocab"], (sum(counts),)), pos, meta, cache)
        assert len(made) == 1 and len(used) == SIZES["layers"]
        assert all(p is made[0] for p in used)
    dpages = Pages(2, max_pages=4, seed=2)
    dcache = dr.make_cache(dpages.num_pages, PAGE)
    meta, pos = dpages.step([4, 4], causal=False)
    made.clear(), used.clear()
    dr.forward_block(torch.randint(0, SIZES["vocab"], (8,)), pos, meta, dcache)
    assert len(made) == 1 and len(used) == 2 and all(p is made[0] for p in used)


# -- KV cache and allocator ------------------------------------------------------------------------
def test_kv_cache_write_lands_in_pages():
    cache = PagedKVCache(2, num_pages=3, page_size=4, h_kv=2, head_dim=8, dtype=torch.float64)
    cache.fill_(float("nan"))
    k, v = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    cache.write(1, k, v, torch.tensor([9, 0, 7]))
    assert torch.equal(cache.k[1][2, 1], k[0]) and torch.equal(cache.v[1][0, 0], v[1])
    assert torch.equal(cache.k[1][1, 3], k[2]) and cache.k[0].isnan().all()
    assert cache.k[1].is_contiguous() and cache.num_slots == 12
    with pytest.raises(KVCacheError, match="must be"):
        cache.write(0, k[:, :1], v, torch.tensor([0, 1, 2]))
