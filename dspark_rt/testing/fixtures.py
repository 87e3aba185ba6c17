"""Tiny random checkpoints in the real on-disk formats, for tests and demos (no downloads).

write_tiny_target   transformers Qwen3 / Llama directory: config.json, safetensors (single or
                    sharded + index), a trained byte-level BPE tokenizer.json whose size equals
                    the model vocab, tokenizer_config.json with a ChatML template.
write_tiny_drafter  DeepSpec Qwen3DSparkModel directory for such a target (any head type).
write_tiny_dflash   z-lab DFlashDraftModel directory for such a target.
"""
import json
import os
import string

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..checkpoint.tensors import Checkpoint, resolve_dtype
from ..train.tokenizer_train import CHAT_TEMPLATE, SPECIAL_TOKENS

__all__ = ["write_tiny_target", "write_tiny_drafter", "write_tiny_dflash", "SPECIAL_TOKENS",
           "CHAT_TEMPLATE"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass.",
    "A paged key value cache stores attention keys and values in fixed size pages.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; the answer is 42.",
    "Lossless rejection sampling keeps the output distribution of the target model.",
] * 4
_STD = 0.02


def _tokenizer(vocab: int) -> Tokenizer:
    """A BPE trained on _CORPUS, padded with reserved tokens to exactly `vocab` ids: byte-level
    (lossless, like Qwen's) when vocab >= 272, else over characters (printable ASCII, most
    frequent in the corpus first; anything else encodes to <unk>)."""
    if vocab >= 256 + len(SPECIAL_TOKENS) + 12:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                      show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        specials = SPECIAL_TOKENS + ["<unk>"]
        if vocab < len(specials) + 1:
            raise ValueError(f"vocab={vocab} is too small for the tiny tokenizer (>= {len(specials) + 1})")
        text = "".join(_CORPUS)
        chars = sorted(set(text), key=lambda c: (-text.count(c), c))
        chars += [c for c in string.printable if c not in chars and c not in "\t\r\x0b\x0c"]
        alphabet = chars[: vocab - len(specials)]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.decoder = decoders.Fuse()
        # initial_alphabet entries outrank corpus counts, so exactly `alphabet` survives the limit
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                      initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator(_CORPUS, trainer)
    n = tok.get_vocab_size()
    if n > vocab:
        raise ValueError(f"vocab={vocab} is too small for the tiny tokenizer (needs >= {n})")
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - n)])
    return tok


def _randn(g, *shape, std=_STD):
    return torch.randn(*shape, generator=g) * std


def _norm_weight(g, n):
    return 1.0 + _randn(g, n, std=0.1)  # not all ones, so a missing norm shows up in tests


def _layer(g, prefix, d, hq, hkv, hd, inter, qk_norm):
    t = {f"{prefix}self_attn.q_proj.weight": _randn(g, hq * hd, d),
         f"{prefix}self_attn.k_proj.weight": _randn(g, hkv * hd, d),
         f"{prefix}self_attn.v_proj.weight": _randn(g, hkv * hd, d),
         f"{prefix}self_attn.o_proj.weight": _randn(g, d, hq * hd),
         f"{prefix}mlp.gate_proj.weight": _randn(g, inter, d),
         f"{prefix}mlp.up_proj.weight": _randn(g, inter, d),
         f"{prefix}mlp.down_proj.weight": _randn(g, d, inter),
         f"{prefix}input_layernorm.weight": _norm_weight(g, d),
         f"{prefix}post_attention_layernorm.weight": _norm_weight(g, d)}
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = _norm_weight(g, hd)
        t[f"{prefix}self_attn.k_norm.weight"] = _norm_weight(g, hd)
    return t


def _save(path, tensors, dtype, sharded=False):
    dt = resolve_dtype(dtype)
    tensors = {k: v.to(dt).contiguous() for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-{len(halves):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _dump(path, "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                 "weight_map": weight_map})


def _dump(path, name, obj):
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def write_tiny_target(path, *, arch="qwen3", vocab=320, hidden=64, layers=2, heads=4, kv_heads=2,
                      head_dim=None, intermediate=None, seed=0, dtype="float32", sharded=False,
                      tie=False, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=512, logit_scale=1.0) -> str:
    """Writes a random transformers Qwen3ForCausalLM / LlamaForCausalLM directory; returns path.
    Weights are N(0, 0.02^2), norm weights 1 + N(0, 0.1^2), so logits have std ~0.02 *
    sqrt(hidden); logit_scale multiplies the final norm weight and so every logit (a peakier
    target). Llama configs omit head_dim when it equals hidden // heads (as real ones do)."""
    if arch not in ("qwen3", "llama"):
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    os.makedirs(path, exist_ok=True)
    hd = head_dim or hidden // heads
    inter = intermediate or 2 * hidden
    tok = _tokenizer(vocab)
    tok.save(os.path.join(path, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {"architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
           "model_type": arch, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": hd, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
           "tie_word_embeddings": tie, "max_position_embeddings": max_position_embeddings,
           "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "torch_dtype": str(resolve_dtype(dtype)).removeprefix("torch.")}
    if arch == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
        if hd == hidden // heads:
            del cfg["head_dim"]
    _dump(path, "config.json", cfg)
    _dump(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_position_embeddings,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE})
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": _randn(g, vocab, hidden)}
    for i in range(layers):
        t.update(_layer(g, f"model.layers.{i}.", hidden, heads, kv_heads, hd, inter, arch == "qwen3"))
    t["model.norm.weight"] = _norm_weight(g, hidden) * logit_scale
    if not tie:
        t["lm_head.weight"] = _randn(g, vocab, hidden)
    _save(path, t, dtype, sharded)
    return path


def _backbone(g, tcfg, target_dir, layers, m, share):
    """Drafter decoder layers, norm, fc, hidden_norm; optionally copied from the target so that
    drafts agree with the target now and then (embedding-dominated tiny targets)."""
    d, hq, hkv = tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd, inter = tcfg.get("head_dim") or d // hq, tcfg["intermediate_size"]
    t = {}
    for i in range(layers):
        t.update(_layer(g, f"layers.{i}.", d, hq, hkv, hd, inter, True))
    t.update({"norm.weight": _norm_weight(g, d), "fc.weight": _randn(g, d, m * d),
              "hidden_norm.weight": _norm_weight(g, d)})
    if share:
        ck = Checkpoint(target_dir)
        src = ck.load([n for n in ck.entries], torch.float32, "cpu")
        for name in list(t):
            key = "model." + name
            if key in src:
                t[name] = src[key].clone()
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                t[name] = torch.ones(hd)  # a Llama target has none: identity norms
        # ctx = the first feature, normed like the target's layer-0 input: with target_layer_ids
        # starting at -1, drafter layer 0's context K/V are exactly the target's layer-0 K/V
        t["fc.weight"] = torch.cat([torch.eye(d)] + [torch.zeros(d, d)] * (m - 1), dim=1)
        t["hidden_norm.weight"] = src["model.layers.0.input_layernorm.weight"].clone()
    return t, (d, hd)


def _default_layer_ids(n_target):
    return sorted({0, max(0, (n_target - 2) // 2), max(0, n_target - 2)})


def _draft_config(tcfg, layers, hd):
    c = {k: v for k, v in tcfg.items() if k not in ("mlp_bias", "pretraining_tp")}
    c.update(model_type="qwen3", num_hidden_layers=layers, head_dim=hd, tie_word_embeddings=False,
             layer_types=["full_attention"] * layers, use_sliding_window=False, sliding_window=None,
             max_window_layers=layers)
    return c


def _mask_id(target_dir):
    return Tokenizer.from_file(os.path.join(target_dir, "tokenizer.json")).token_to_id("<|mask|>")


def write_tiny_drafter(path, target_dir, *, head="vanilla", layers=1, block_size=4,
                       target_layer_ids=None, markov_rank=16, confidence=True,
                       confidence_markov=True, seed=0, share_target_layers=False,
                       dtype="float32") -> str:
    """Writes a random DeepSpec Qwen3DSparkModel drafter for the target in target_dir. head is
    "vanilla" | "gated" | "rnn" | "none" (markov_rank 0; confidence_markov is then ignored)."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    n_target, V = tcfg["num_hidden_layers"], tcfg["vocab_size"]
    ids = list(target_layer_ids if target_layer_ids is not None else _default_layer_ids(n_target))
    rank = 0 if head == "none" else markov_rank
    conf_markov = confidence and confidence_markov and rank > 0
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t, (d, hd) = _backbone(g, tcfg, target_dir, layers, len(ids), share_target_layers)
    cfg = _draft_config(tcfg, layers, hd)
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=n_target,
               block_size=block_size, target_layer_ids=ids, mask_token_id=_mask_id(target_dir),
               num_anchors=512, markov_rank=rank, enable_confidence_head=confidence)
    # head scales: e = w1[x] ~ N(0, 1) like an embedding row and the bias w2 @ e ~ N(0, 0.1^2),
    # comparable to the base logits (std 0.02 * sqrt(hidden)), so a head bug changes drafts
    if rank:
        cfg["markov_head_type"] = head
        t["markov_head.markov_w1.weight"] = _randn(g, V, rank, std=1.0)
        t["markov_head.markov_w2.weight"] = _randn(g, V, rank, std=0.1 / rank ** 0.5)
    if head == "gated":
        t["markov_head.gate_proj.weight"] = _randn(g, rank, d + rank, std=(d + rank) ** -0.5)
        t["markov_head.gate_proj.bias"] = _randn(g, rank, std=0.1)
    elif head == "rnn":
        t["markov_head.joint_proj.weight"] = _randn(g, 3 * rank, 2 * rank + d,
                                                    std=(2 * rank + d) ** -0.5)
        t["markov_head.joint_proj.bias"] = _randn(g, 3 * rank, std=0.1)
    if confidence:
        cfg["confidence_head_with_markov"] = conf_markov
        k = d + rank if conf_markov else d
        t["confidence_head.proj.weight"] = _randn(g, 1, k, std=k ** -0.5)  # logit ~ 1 + N(0, 1)
        t["confidence_head.proj.bias"] = torch.ones(1)
    # DeepSpec checkpoints carry copies of the target's embedding and LM head
    src = Checkpoint(target_dir)
    emb = src.load(["model.embed_tokens.weight"], torch.float32, "cpu")["model.embed_tokens.weight"]
    t["embed_tokens.weight"] = emb
    t["lm_head.weight"] = src.load(["lm_head.weight"], torch.float32, "cpu")["lm_head.weight"] \
        if "lm_head.weight" in src.entries else emb.clone()
    _dump(path, "config.json", cfg)
    _save(path, t, dtype)
    return path


def write_tiny_dflash(path, target_dir, *, layers=1, block_size=4, target_layer_ids=None, seed=0,
                      share_target_layers=False, dtype="float32") -> str:
    """Writes a random z-lab DFlashDraftModel drafter (1+N layout, no embedding / LM head)."""
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    ids = list(target_layer_ids if target_layer_ids is not None
               else _default_layer_ids(tcfg["num_hidden_layers"]))
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t, (_, hd) = _backbone(g, tcfg, target_dir, layers, len(ids), share_target_layers)
    cfg = _draft_config(tcfg, layers, hd)
    cfg.update(architectures=["DFlashDraftModel"], block_size=block_size,
               auto_map={"AutoModel": "dflash.DFlashDraftModel"},
               dflash_config={"mask_token_id": _mask_id(target_dir), "target_layer_ids": ids})
    _dump(path, "config.json", cfg)
    _save(path, t, dtype)
    return path
