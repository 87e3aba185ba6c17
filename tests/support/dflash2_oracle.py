"""A DFlash2 oracle: a drafter whose selector drafts the most frequent successor of the previous
token in given sequences (a bigram table of the target's own greedy text), so its drafts are
accepted. Its backbone is live but scaled down (o_proj and down_proj x 0.01), so every draft
slot's hidden state stays close to the normed mask embedding h0; the hidden projection maps h0
to the all-ones vector, so the selector's bias is <A[prev], B[b]>, with B built so that it is
large exactly for the recorded successor of prev. Used by tests/models/test_dflash2.py and
tests/parallel/test_tensor_parallel.py."""
from collections import Counter

import torch

from tests.support import packagings as pk
from tests.support.shipped_pair import TARGET


def oracle_dflash2(tmp, sequences, target=TARGET, *, rank=128, top_k=2048, scale=20.0,
                   block_size=8, target_layer_ids=(0, 1, 2)):
    """A DFlash2 (block 8: gamma 7) over `target` whose selector drafts the most frequent
    successor of the previous token in `sequences` (module docstring)."""
    path = pk.dflash2(tmp, target, layers=1, block_size=block_size, rank=rank, top_k=top_k,
                      seed=2, output_multiplier=0.01, softcap=0.0, target_layer_ids=target_layer_ids)
    cfg, t = pk.read(path)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        t[name] = t[name] * 0.01
    emb = pk.read(target)[1]["model.embed_tokens.weight"].double()
    e = emb[cfg["dflash_config"]["mask_token_id"]]
    h0 = t["norm.weight"].double() * e * torch.rsqrt(e.pow(2).mean() + cfg["rms_norm_eps"])
    t["candidate_selector.hidden_projection.weight"] = \
        (torch.ones(rank, 1, dtype=torch.float64) * (h0 / h0.pow(2).sum())).float()
    V = emb.shape[0]
    g = torch.Generator().manual_seed(7)
    A = torch.randn(V, rank, generator=g) / rank ** 0.5
    pairs = Counter((a, b) for s in sequences for a, b in zip(s, s[1:]))
    succ = {}
    for (a, b), n in sorted(pairs.items(), key=lambda kv: kv[1]):
        succ[a] = b  # the most frequent successor wins (ascending counts, last write)
    B = torch.zeros(V, rank)
    for a, b in succ.items():
        B[b] += scale * A[a]
    t["candidate_selector.predecessor_codebook"] = A
    t["candidate_selector.successor_codebook"] = B
    return pk._write(path, cfg, t)
