"""Held-out loss of a target: next-token cross-entropy on the corpus files it never trained on.

The held-out files are the same for every byte cap and tokenizer (every 25th file of the seeded
shuffle, corpus.load_corpus), so two targets with different tokenizers compare by bits per byte
of source text; nats per token is reported too. Each file is tokenized alone, followed by
<|endoftext|>, and scored in consecutive windows of `seq` tokens (the first token of a window has
no context from the previous one, as in training).
"""
import math
import time

import torch
import torch.nn.functional as F

from ..models.qwen3 import Qwen3Model, Rotary
from .corpus import EOT, load_corpus
from .dense import target_forward
from .tokenizer_train import load_tokenizer

__all__ = ["heldout_loss"]


@torch.no_grad()
def heldout_loss(target_dir, *, corpus=None, seed=0, seq=512) -> dict:
    tok = load_tokenizer(target_dir)
    files = load_corpus(corpus, max_bytes=1, seed=seed).heldout
    if not files:
        raise ValueError("the corpus holds out no file")
    model = Qwen3Model.from_pretrained(target_dir, dtype="float32")
    model.rotary = Rotary(model.config, torch.float32, "cpu")
    eot = tok.token_to_id(EOT)
    nats, tokens, t0 = 0.0, 0, time.perf_counter()
    for text in files:
        ids = torch.tensor(tok.encode(text).ids + [eot], dtype=torch.int64)
        for s in range(0, len(ids) - 1, seq):
            w = ids[s: s + seq + 1]
            logits, _, _ = target_forward(model, w[None, :-1])
            nats += F.cross_entropy(logits[0].float(), w[1:], reduction="sum").item()
            tokens += len(w) - 1
    n_bytes = sum(len(t.encode()) for t in files)
    return {"files": len(files), "tokens": tokens, "bytes": n_bytes,
            "nats_per_token": nats / tokens, "bits_per_byte": nats / math.log(2) / n_bytes,
            "seconds": time.perf_counter() - t0}
