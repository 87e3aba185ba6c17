"""Writers of drafter checkpoints in the packagings published on hubs (dspark_rt/drafter_formats.py).

Each writer takes a drafter in the canonical DeepSpec layout (a Qwen3DSparkModel folder) and
writes the *same weights* in another packaging, so a test can check that both load to the same
drafter: same tokens, same acceptance round by round. Field and tensor names follow the
references cited in dspark_rt/drafter_formats.py; the transformers class defaults that
speculators' `to_diff_dict` leaves out come from the installed transformers itself (an
independent source for the loader's table).
"""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["read", "deepspec_stock", "forked_label", "speculators", "specforge", "specforge_sglang",
           "zlab", "with_fields", "conf_without_bias", "interleaved", "masked_vocab_canonical"]

_LAYER_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id")


def read(src) -> tuple:
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(src, "model.safetensors"))


def _write(out, cfg, tensors, extra_files=()) -> Path:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    for path in extra_files:
        shutil.copy(path, out)
    return Path(out)


def _target_tensors(target_dir):
    t = load_file(os.path.join(target_dir, "model.safetensors"))
    emb = t["model.embed_tokens.weight"]
    return emb, t.get("lm_head.weight", emb)


def with_fields(src, out, drop=(), **fields) -> str:
    """The canonical folder with config fields added / changed (None: removed)."""
    cfg, t = read(src)
    cfg.update(fields)
    for k in [k for k, v in cfg.items() if v is None and k in fields] + list(drop):
        cfg.pop(k, None)
    return _write(out, cfg, t)


def deepspec_stock(src, out, target_dir) -> str:
    """DeepSpec as published: the target's config copied whole (target-only fields included:
    a partial-rotary factor, sliding-window fields, transformers-5 rope_parameters), and copies
    of the target's embedding and LM head (deepspec/modeling/dspark/qwen3/config.py)."""
    cfg, t = read(src)
    cfg.update(partial_rotary_factor=0.25, use_sliding_window=True, sliding_window=16,
               max_window_layers=0, rope_parameters={"rope_type": "default",
                                                     "rope_theta": cfg["rope_theta"],
                                                     "partial_rotary_factor": 0.25},
               num_anchors=512, _attn_implementation="flex_attention")
    emb, head = _target_tensors(target_dir)
    t["embed_tokens.weight"], t["lm_head.weight"] = emb.clone(), head.clone()
    return _write(out, cfg, t)


def forked_label(src, out) -> str:
    """DeepSpec tensors under a fork's label and names: `DSparkDraftModel`, every tensor under
    `model.`, the confidence head's Linear stored without its `.proj` module."""
    cfg, t = read(src)
    cfg["architectures"] = ["DSparkDraftModel"]
    renamed = {}
    for k, v in t.items():
        k = k.replace("confidence_head.proj.", "confidence_head.")
        renamed[k if k.startswith("confidence_head.") else "model." + k] = v
    return _write(out, cfg, renamed)


def _diff_layer_config(cfg, model_type):
    """transformer_layer_config as speculators writes it (PretrainedConfig.to_diff_dict of
    transformers 4: keys equal to the class default are left out)."""
    import transformers
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[model_type]
    defaults = cls().to_dict()
    defaults["rope_theta"] = (defaults.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    defaults["rope_scaling"] = None
    layer = {k: cfg[k] for k in _LAYER_KEYS if k in cfg}
    layer["model_type"] = model_type
    return {k: v for k, v in layer.items() if k == "model_type" or defaults.get(k, object()) != v}


def speculators(src, out, target_dir, *, legacy=False, draft_ids=None, model_type="qwen3") -> str:
    """vllm-project/speculators DSpark format. legacy: `DSparkSpeculator` without
    `sample_from_anchor` (the anchor slot implied by speculative_tokens). draft_ids: a reduced
    draft vocabulary (sorted target ids): d2t offsets, t2d mask, draft-vocabulary lm_head and
    markov_w2 rows."""
    cfg, t = read(src)
    anchor_first = not cfg.get("dspark_bonus_anchor", False)
    B, V = cfg["block_size"], cfg["vocab_size"]
    rank = cfg.get("markov_rank", 0)
    kind = "dspark" if rank else "dflash"  # speculators' DFlash: no Markov / confidence fields
    label = {"dspark": ("DSparkSpeculator", "DSparkDraftModel"),
             "dflash": ("DFlashSpeculator", "DFlashDraftModel")}[kind][0 if legacy else 1]
    out_cfg = {
        "architectures": [label], "speculators_model_type": kind, "speculators_version": "0.5.0",
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": B if anchor_first else B - 1}],
            "verifier": {"name_or_path": str(target_dir), "architectures": ["Qwen3ForCausalLM"]}},
        "transformer_layer_config": _diff_layer_config(cfg, model_type),
        "draft_vocab_size": V if draft_ids is None else len(draft_ids),
        "block_size": B, "num_anchors": 256, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg["target_layer_ids"]],
        "mask_token_id": cfg["mask_token_id"], "markov_rank": rank,
        "markov_head_type": cfg.get("markov_head_type", "vanilla"),
        "enable_confidence_head": cfg.get("enable_confidence_head", False),
        "confidence_head_with_markov": cfg.get("confidence_head_with_markov", False),
        "ce_loss_alpha": 0.1, "l1_loss_alpha": 0.0, "confidence_head_alpha": 1.0,
        "loss_decay_gamma": None}
    if not legacy:
        out_cfg["sample_from_anchor"] = anchor_first
    if kind == "dflash":
        for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                  "confidence_head_with_markov", "confidence_head_alpha"):
            del out_cfg[k]
    t = {k: v for k, v in t.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    if draft_ids is not None:
        ids = torch.as_tensor(draft_ids, dtype=torch.long)
        _, head = _target_tensors(target_dir)
        t["lm_head.weight"] = head[ids].clone()
        t["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
        if rank:
            t["markov_head.markov_w2.weight"] = t["markov_head.markov_w2.weight"][ids].clone()
    return _write(out, out_cfg, t)


def masked_vocab_canonical(src, out, draft_ids) -> str:
    """The canonical (DeepSpec) drafter whose proposals are restricted to draft_ids: one more
    Markov rank, embedding 1 for every token, projection 0 on draft_ids and -inf elsewhere
    (vanilla head). The law a reduced-vocabulary checkpoint of the same weights defines."""
    cfg, t = read(src)
    r, V = cfg["markov_rank"], cfg["vocab_size"]
    if r and cfg.get("markov_head_type") != "vanilla":
        raise ValueError("masked_vocab_canonical writes vanilla heads (or none) only")
    if r == 0:  # no head: the restriction alone, as a rank-1 vanilla head
        cfg["markov_head_type"] = "vanilla"
        t["markov_head.markov_w1.weight"] = torch.zeros(V, 0)
        t["markov_head.markov_w2.weight"] = torch.zeros(V, 0)
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    col = torch.full((V, 1), float("-inf"), dtype=w2.dtype)
    col[torch.as_tensor(draft_ids)] = 0
    t["markov_head.markov_w1.weight"] = torch.cat([w1, torch.ones(V, 1, dtype=w1.dtype)], 1)
    t["markov_head.markov_w2.weight"] = torch.cat([w2, col], 1)
    if cfg.get("confidence_head_with_markov"):
        w = t["confidence_head.proj.weight"]
        t["confidence_head.proj.weight"] = torch.cat([w, torch.zeros(1, 1, dtype=w.dtype)], 1)
    cfg["markov_rank"] = r + 1
    return _write(out, cfg, t)


# What SpecForge's `export --to hf` writes (sgl-project/SpecForge, main of 2026-08):
# specforge/export/to_hf.py export_to_hf builds the draft from the user's draft config
# (modeling/auto.py AutoDraftModelConfig.from_file: tie_word_embeddings forced False,
# draft_vocab_size = vocab_size when absent), loads the trained tensors unchanged ("trained keys
# win"; a DFlash-family draft owns no embedding), and saves it with save_pretrained (transformers 5:
# rope_parameters, dtype); export/checkpoint_io.py apply_legacy_rope_scaling then mirrors
# rope_theta and a non-default rope_parameters into rope_scaling. DSparkDraftModel.__init__
# (modeling/draft/dspark.py) adds dflash_config.attention_mode and projector_type "dspark"; the
# other dflash_config keys are the user's, read with dspark.py's defaults (markov_rank 0,
# enable_confidence_head = confidence_head_alpha > 0, confidence_head_with_markov False).
# target_layer_ids are target layer indices (dflash.py extract_context_feature reads
# hidden_states[id + 1]), as in DeepSpec. The block is anchor-first, as in DeepSpec: the DSpark
# objective labels slot k with anchor + k + 1 (algorithms/common/dflash_family_model.py
# OnlineDSparkModel._build_dspark_labels_and_mask), and nothing in the file says so.
_SPECFORGE_LAYER_KEYS = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
                         "head_dim", "hidden_act", "hidden_size", "intermediate_size", "layer_types",
                         "max_position_embeddings", "max_window_layers", "model_type",
                         "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                         "rms_norm_eps", "sliding_window", "use_sliding_window", "vocab_size")


def specforge(src, out, *, rope_scaling=None, minimal=False) -> str:
    """A DeepSpec-trained drafter as SpecForge's exporter writes it (see above): `DSparkDraftModel`,
    head fields nested in `dflash_config`, no embedding / LM head. minimal: the draft config
    gave only mask_token_id and target_layer_ids (configs/qwen3-8b-dflash.json's shape), the
    head fields left to SpecForge's defaults (a drafter without heads only)."""
    cfg, t = read(src)
    out_cfg = {k: cfg[k] for k in _SPECFORGE_LAYER_KEYS if k in cfg}
    nested = {"attention_mode": "gqa", "mask_token_id": cfg["mask_token_id"],
              "target_layer_ids": cfg["target_layer_ids"], "projector_type": "dspark"}
    rank, conf = cfg.get("markov_rank", 0), cfg.get("enable_confidence_head", False)
    if minimal:
        if rank or conf:
            raise ValueError("minimal writes drafters without a Markov or confidence head")
    else:
        nested.update(markov_rank=rank, enable_confidence_head=conf,
                      confidence_head_alpha=1.0 if conf else 0.0,
                      confidence_head_with_markov=cfg.get("confidence_head_with_markov", False))
        if rank:
            nested["markov_head_type"] = cfg["markov_head_type"]
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": cfg["rope_theta"]}
    out_cfg.update(architectures=["DSparkDraftModel"],
                   auto_map={"AutoModel": "dspark.DSparkDraftModel"},
                   block_size=cfg["block_size"], num_target_layers=cfg["num_target_layers"],
                   dflash_config=nested, draft_vocab_size=cfg["vocab_size"], dtype="bfloat16",
                   initializer_range=0.02, pad_token_id=None, tie_word_embeddings=False,
                   use_cache=True, transformers_version="5.8.1", rope_parameters=rope,
                   rope_theta=cfg["rope_theta"])
    if rope_scaling is not None:
        out_cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    t = {k: v for k, v in t.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    return _write(out, dict(sorted(out_cfg.items())), t)


def specforge_sglang(src, out) -> str:
    """A SpecForge export after SpecForge's SGLang normaliser (scripts/gates/
    normalize_dflash_export.py _normalize_dspark): the four head fields copied to the top level,
    `Qwen3DSparkModel`, auto_map dropped, dflash_config kept. It requires markov_rank > 0."""
    p = specforge(src, out)
    cfg, t = read(p)
    dc = cfg["dflash_config"]
    if not dc.get("markov_rank"):
        raise ValueError("SpecForge's normaliser refuses markov_rank 0")
    for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov"):
        if k in dc:
            cfg[k] = dc[k]
    cfg["architectures"] = ["Qwen3DSparkModel"]
    cfg.pop("auto_map", None)
    return _write(out, cfg, t)


def zlab(src, out, *, sliding_window=None) -> str:
    """z-lab DFlash with the nested dflash_config (block_size inside it). sliding_window: every
    layer a sliding_attention layer of that window, which z-lab runs causally inside the block
    (dflash/model.py Qwen3DFlashAttention: is_causal unset)."""
    cfg, t = read(src)
    n = cfg["num_hidden_layers"]
    nested = {"mask_token_id": cfg.pop("mask_token_id"), "block_size": cfg.pop("block_size"),
              "target_layer_ids": cfg.pop("target_layer_ids")}
    for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov", "num_anchors", "dspark_bonus_anchor", "is_causal"):
        cfg.pop(k, None)
    cfg.update(architectures=["DFlashDraftModel"], dflash_config=nested,
               auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    if sliding_window is not None:
        cfg.update(layer_types=["sliding_attention"] * n, use_sliding_window=True,
                   sliding_window=sliding_window, max_window_layers=n)
    t = {k: v for k, v in t.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    return _write(out, cfg, t)


def conf_without_bias(src, out) -> tuple:
    """(packaged, canonical): the confidence Linear stored without a bias (SGLang's
    DSparkConfidenceHead(bias=False)), and the canonical folder with that bias set to 0."""
    cfg, t = read(src)
    t2 = {k: v for k, v in t.items() if k != "confidence_head.proj.bias"}
    packaged = _write(os.path.join(out, "packaged"), cfg, t2)
    t["confidence_head.proj.bias"] = torch.zeros_like(t["confidence_head.proj.bias"])
    return packaged, _write(os.path.join(out, "canonical"), cfg, t)


def interleaved(src, out) -> str:
    """q/k projections (and their norms) stored for pair-interleaved rotary, `rope_interleave`
    set: the same attention as the half-split layout of the canonical folder."""
    cfg, t = read(src)
    hd = cfg["head_dim"]
    # canonical position i (< hd/2) rotates with i + hd/2; interleaved stores them at 2i, 2i+1
    inv = torch.empty(hd, dtype=torch.long)
    inv[0::2], inv[1::2] = torch.arange(hd // 2), torch.arange(hd // 2, hd)
    for k in [k for k in t if k.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight",
                                          "k_norm.weight"))]:
        w = t[k]
        t[k] = w.view(-1, hd, *w.shape[1:])[:, inv].reshape(w.shape).clone()
    cfg["rope_interleave"] = True
    return _write(out, cfg, t)


def dflash2(out, target_dir, *, layers=2, block_size=5, kernel_size=2, group_size=8, rank=8,
            top_k=6, seed=0, output_multiplier=0.5, softcap=20.0, target_layer_ids=(-1, 1)) -> Path:
    """A random z-lab DFlash2DraftModel (z-lab/dflash tests/fixtures/dflash2-config.json and
    -safetensors-header.json): DFlash backbone plus attention_conv / mlp_conv per layer and a
    candidate_selector whose codebooks are stored without `.weight`; bidirectional
    (`is_causal: false`) sliding layers."""
    from dspark_rt import testing
    src = testing.write_tiny_dflash(Path(out) / "base", target_dir, layers=layers,
                                    block_size=block_size, target_layer_ids=list(target_layer_ids),
                                    seed=seed)
    cfg, t = read(src)
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed + 1)
    groups = d // group_size
    for i in range(layers):
        for c in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, kernel_size, d)
            base[:, 0] = 1.0  # identity tap plus noise, so the sublayers keep their scale
            t[f"layers.{i}.{c}.base_kernel"] = base + 0.2 * torch.randn(2, kernel_size, d, generator=g)
            t[f"layers.{i}.{c}.kernel_projection.weight"] = \
                0.1 * torch.randn(2 * kernel_size * groups, d, generator=g)
    t["candidate_selector.hidden_projection.weight"] = torch.randn(rank, d, generator=g) / d ** 0.5
    t["candidate_selector.predecessor_codebook"] = torch.randn(V, rank, generator=g)
    t["candidate_selector.successor_codebook"] = torch.randn(V, rank, generator=g)
    nested = cfg.pop("dflash_config")
    nested.update(block_size=cfg.pop("block_size"), conv_group_size=group_size,
                  conv_kernel_size=kernel_size, selector_rank=rank, selector_top_k=top_k,
                  output_multiplier=output_multiplier, final_logit_softcapping=softcap)
    cfg.update(architectures=["DFlash2DraftModel"], dflash_config=nested, is_causal=False,
               layer_types=["sliding_attention"] * layers, use_sliding_window=True,
               sliding_window=cfg["max_position_embeddings"], max_window_layers=layers)
    cfg.pop("auto_map", None)
    return _write(Path(out) / "dflash2", cfg, t)
