"""Pretraining a tiny Qwen3 target with a causal LM loss; writes a Hugging Face Qwen3 folder
(config.json, model.safetensors, tokenizer files) that Qwen3Model.from_pretrained loads.

Initialisation: every matrix N(0, 0.02^2), the residual outputs (o_proj, down_proj) scaled by
1 / sqrt(2 * layers) as in GPT-2, norm weights 1. Embedding and LM head are tied (smaller files).
Or init: the weights (and shape) of a target folder, to train it further, e.g. with the
unlikelihood term (unlikelihood.py) that discourages greedy repetition loops.
"""
import json
import math
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..checkpoint.tensors import resolve_dtype
from ..checkpoint.config import TargetConfig
from ..models.qwen3 import Qwen3Model, Rotary
from .corpus import EOT, TokenStream, load_corpus
from .dense import target_forward
from .loop import train_loop
from .tokenizer_train import load_tokenizer, special_ids
from .unlikelihood import greedy_continue, repeat_mask, sequence_unlikelihood_loss, unlikelihood_loss

__all__ = ["target_config", "init_target", "save_target", "pretrain"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def target_config(tok, *, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
                  intermediate=768, ctx=512, dtype="bfloat16") -> dict:
    ids = special_ids(tok)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "vocab_size": tok.get_vocab_size(), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": None, "tie_word_embeddings": True, "max_position_embeddings": ctx,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "bos_token_id": ids[EOT], "eos_token_id": [ids[EOT], ids["<|im_end|>"]],
            "torch_dtype": dtype}


def init_target(cfg: dict, seed: int) -> Qwen3Model:
    tc = TargetConfig.from_dict(cfg)
    torch.manual_seed(seed)
    model = Qwen3Model(tc)
    model.rotary = Rotary(tc, torch.float32, "cpu")
    resid_std = 0.02 / math.sqrt(2 * tc.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p)
        else:
            resid = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, std=resid_std if resid else 0.02)
    return model


def save_target(model: Qwen3Model, cfg: dict, out, tokenizer_dir, dtype="bfloat16"):
    """HF layout: model.* names, no lm_head.weight (tied)."""
    os.makedirs(out, exist_ok=True)
    dt = resolve_dtype(dtype)
    tensors = {("lm_head.weight" if n == "lm_head_weight" else "model." + n):
               t.detach().to(dt).contiguous() for n, t in model.state_dict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**cfg, "torch_dtype": str(dt).removeprefix("torch.")}, f, indent=2)
    if os.path.abspath(tokenizer_dir) != os.path.abspath(out):
        for name in _TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out, name))


def pretrain(*, tokenizer_dir, out, corpus=None, max_bytes=6_000_000, hidden=256, layers=4,
             heads=4, kv_heads=2, head_dim=64, intermediate=768, ctx=512, steps=400, batch=8,
             seq=512, lr=2e-3, warmup=30, weight_decay=0.1, seed=0, save_every=50, resume=False,
             compile=False, dtype="bfloat16", progress=True, init=None, unlikelihood=0.0,
             seq_unlikelihood=0.0, seq_prefix=64, seq_new=64) -> dict:
    """Trains the target and writes it to `out`; returns the loop summary (+ corpus stats).
    init: a target folder to start from (its shape wins over the shape arguments).
    unlikelihood: weight alpha of the token-level unlikelihood term (0: plain cross-entropy).
    seq_unlikelihood: weight of the sequence-level term: each step the model also continues
    `batch` prefixes of seq_prefix corpus tokens greedily by seq_new tokens, and the tokens of
    its continuation in repeated 4-grams are pushed down (unlikelihood.py)."""
    torch.manual_seed(seed)
    tok = load_tokenizer(tokenizer_dir)
    if unlikelihood < 0 or seq_unlikelihood < 0:
        raise ValueError(f"unlikelihood weights must be >= 0, got {unlikelihood}, {seq_unlikelihood}")
    if init is not None:
        with open(os.path.join(init, "config.json"), encoding="utf-8") as f:
            cfg = {**json.load(f), "torch_dtype": dtype}
        ctx = cfg["max_position_embeddings"]
    else:
        cfg = target_config(tok, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, intermediate=intermediate, ctx=ctx, dtype=dtype)
    if seq > ctx:
        raise ValueError(f"--seq {seq} is longer than the model context {ctx}")
    if cfg["vocab_size"] != tok.get_vocab_size():
        raise ValueError(f"init {init} has vocab_size {cfg['vocab_size']}, the tokenizer "
                         f"{tok.get_vocab_size()}")
    model = init_target(cfg, seed)
    if init is not None:
        model.load_state_dict(Qwen3Model.from_pretrained(init, dtype="float32").state_dict())
    data = load_corpus(corpus, max_bytes=max_bytes, seed=seed)
    stream = TokenStream(data.train, tok, special_ids(tok)[EOT])
    V = cfg["vocab_size"]

    def loss_of(ids):
        logits, _, _ = target_forward(model, ids[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        if not unlikelihood:
            return ce, ce
        return ce + unlikelihood * unlikelihood_loss(logits, ids[:, :-1], ids[:, 1:]), ce

    fn = torch.compile(loss_of, dynamic=False) if compile else loss_of

    def step_fn(step):
        loss, ce = fn(stream.batch(step, seed, batch, seq + 1))
        parts = {"ce": ce.detach()} if unlikelihood or seq_unlikelihood else {}
        if seq_unlikelihood:
            prefix = stream.batch(step, seed + 1, batch, seq_prefix)
            ids = greedy_continue(lambda x: target_forward(model, x)[0], prefix, seq_new)
            mask = repeat_mask(ids, seq_prefix)
            logits, _, _ = target_forward(model, ids[:, :-1])
            sul = sequence_unlikelihood_loss(logits, ids, mask)
            loss = loss + seq_unlikelihood * sul
            parts.update(seq_ul=sul.detach(), repeats=mask[:, seq_prefix:].float().mean())
        return loss, parts

    summary = train_loop(model, step_fn, out=out, steps=steps, lr=lr, warmup=warmup,
                         weight_decay=weight_decay, save_every=save_every, resume=resume,
                         export=lambda: save_target(model, cfg, out, tokenizer_dir, dtype),
                         desc="pretrain target", progress=progress)
    summary.update(train_tokens=len(stream), train_bytes=data.train_bytes, init=init,
                   unlikelihood=unlikelihood, seq_unlikelihood=seq_unlikelihood,
                   tokens_seen=steps * batch * seq,
                   params=sum(p.numel() for p in model.parameters()))
    return summary
