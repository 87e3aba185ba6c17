"""Training a DSpark (or DFlash) drafter against a frozen target (DESIGN §2; the DSpark paper's
objective).

Per step: B sequences of length L; the frozen target gives the context features of every
position (layers target_layer_ids) and its distribution P at every position; A anchors p per
sequence are drawn (distinct, in [1, L-1-gamma]). Block a is [x_p, m, ..., m] at positions
p..p+gamma-1 with context = features of positions < p; h_k predicts position p+k, whose target
distribution is P at p+k-1. With z_k = U_k + bias_k (U = target lm_head(h_k); the sequential head
fed the sequence's own tokens x_{k-1} = seq[p+k-1], teacher forcing; the rnn head's state runs
along the block over those tokens) and q_k = softmax(z_k):

  loss_k = 0.1 * CE(z_k, argmax P_{p+k-1})            (the target's greedy next token)
         + 0.9 * TV(q_k, P_{p+k-1}),  TV = 1/2 ||q - P||_1
         + 1.0 * BCE(sigmoid(conf_k), 1 - TV(q_k, P))  (label detached: analytic acceptance)
  loss   = sum_k w_k loss_k / sum_k w_k,  w_k = exp(-(k-1)/gamma)  (early positions gate all later
           ones, so they weigh more), averaged over anchors and sequences.

DFlash (--head none) drops the head (z = U) and, by default, the confidence term. With
--upgrade-dflash the backbone of a trained DFlash drafter is loaded and frozen (run without
gradients) and only the sequential and confidence heads train. The target, its embedding and its
LM head are frozen throughout.
"""
import json
import os

import torch
import torch.nn.functional as F

from ..checkpoint.tensors import Checkpoint
from ..checkpoint.drafter_config import DrafterConfig
from ..models.qwen3 import Qwen3Model, Rotary
from .corpus import EOT, TokenStream, load_corpus
from .dense import drafter_block_forward, target_forward
from .drafter_net import DrafterNet, default_layer_ids, drafter_config, save_drafter
from .loop import train_loop
from .tokenizer_train import load_tokenizer

__all__ = ["train_drafter", "drafter_loss", "position_weights", "sample_anchors"]

W_CE, W_TV, W_CONF = 0.1, 0.9, 1.0


def position_weights(gamma: int, device=None) -> torch.Tensor:
    k = torch.arange(gamma, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def sample_anchors(g: torch.Generator, B: int, A: int, L: int, gamma: int, lo: int = 1):
    """[B, A] distinct anchors per sequence in [lo, L-1-gamma], sorted."""
    hi = L - gamma  # exclusive: the block's last label sits at p + gamma <= L - 1
    n = hi - lo
    if n < A:
        raise ValueError(f"sequences of {L} tokens hold only {n} anchors of a gamma-{gamma} block, "
                         f"asked for {A}")
    return torch.stack([torch.randperm(n, generator=g)[:A].sort().values + lo for _ in range(B)])


def drafter_loss(net, target, rotary, seqs, anchors, *, frozen_backbone=False):
    """seqs [B, L] int64, anchors [B, A] -> (loss, parts {ce, tv, acc[, bce]}): see the module
    doc; acc = argmax agreement of z with the target (diagnostic)."""
    gamma = net.cfg["block_size"]
    B, L = seqs.shape
    with torch.no_grad():
        _, feats, hidden_t = target_forward(target, seqs, capture=net.cfg["target_layer_ids"],
                                            logits=False)
        pos = anchors[:, :, None] + torch.arange(gamma)  # [B, A, gamma]: p + k - 1
        rows = torch.gather(hidden_t, 1, pos.reshape(B, -1, 1).expand(-1, -1, hidden_t.shape[-1]))
        logp = torch.log_softmax(target.lm_head(rows).view(*pos.shape, -1), dim=-1)
        labels = logp.argmax(-1)
        prev = torch.gather(seqs, 1, pos.reshape(B, -1)).view_as(pos)  # x_{k-1} = seq[p + k - 1]
    block = torch.full_like(pos, net.cfg["mask_token_id"])
    block[:, :, 0] = prev[:, :, 0]
    with torch.set_grad_enabled(not frozen_backbone and torch.is_grad_enabled()):
        h = drafter_block_forward(net, rotary, target.embed_tokens, feats, block, anchors)
        U = target.lm_head(h)
    z, conf = net.heads(U, h, prev)
    logq = torch.log_softmax(z, dim=-1)
    ce = F.nll_loss(logq.reshape(-1, logq.shape[-1]), labels.reshape(-1),
                    reduction="none").view(pos.shape)
    tv = 0.5 * (logq.exp() - logp.exp()).abs().sum(-1)
    per = W_CE * ce + W_TV * tv
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
        per = per + W_CONF * bce
    w = position_weights(gamma)
    loss = (per * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        acc = (z.argmax(-1) == labels).float().mean()
    parts = {"ce": ce.mean().detach(), "tv": tv.mean().detach(), "acc": acc}
    if conf is not None:
        parts["bce"] = bce.mean().detach()
    return loss, parts


def _data(data, target_dir, corpus, max_bytes, seed, seq):
    """A function (step, g, B) -> [B, L] sequences: regen rows or corpus windows."""
    if data:
        blob = torch.load(data, map_location="cpu", weights_only=False)
        rows = blob["tokens"]
        return (lambda step, g, B: rows[torch.randint(0, len(rows), (B,), generator=g)]), \
            rows.shape[1], {"data": data, "data_sequences": len(rows)}
    tok = load_tokenizer(target_dir)
    stream = TokenStream(load_corpus(corpus, max_bytes=max_bytes, seed=seed).train, tok,
                         tok.token_to_id(EOT))
    return (lambda step, g, B: stream.batch(step, seed, B, seq)), seq, \
        {"data": "corpus", "data_tokens": len(stream)}


def _build_net(target_dir, tcfg, *, head, gamma, layers, rank, target_layer_ids, confidence,
               upgrade_dflash):
    if upgrade_dflash:
        base = DrafterConfig.from_json(upgrade_dflash)
        if base.format != "deepspec" or base.head != "none":
            raise ValueError(f"{upgrade_dflash}: --upgrade-dflash needs a DeepSpec DFlash drafter "
                             f"(markov_rank 0), got format {base.format}, head {base.head}")
        if head == "none":
            raise ValueError("--upgrade-dflash adds a sequential head: pass --head vanilla|gated|rnn")
        gamma, layers = base.block_size, base.num_hidden_layers
        target_layer_ids = list(base.target_layer_ids)
    mask_id = load_tokenizer(target_dir).token_to_id("<|mask|>")
    ids = target_layer_ids or default_layer_ids(tcfg["num_hidden_layers"])
    conf = (head != "none") if confidence is None else confidence
    cfg = drafter_config(tcfg, layers=layers, gamma=gamma, target_layer_ids=ids,
                         mask_token_id=mask_id, head=head, rank=rank, confidence=conf)
    net = DrafterNet(cfg)
    if upgrade_dflash:
        ck = Checkpoint(upgrade_dflash)
        own = net.state_dict()
        state = ck.load([n for n in ck.entries if n in own], torch.float32, "cpu")
        missing = [n for n in own if n not in state
                   and not n.startswith(("markov_head", "confidence_head"))]
        if missing:
            raise ValueError(f"{upgrade_dflash}: backbone tensors missing: {missing[:4]}")
        net.load_state_dict(state, strict=False)
        for p in net.backbone_parameters():
            p.requires_grad_(False)
    return net


def train_drafter(*, target_dir, out, data=None, head="vanilla", gamma=7, layers=1, rank=128,
                  target_layer_ids=None, confidence=None, upgrade_dflash=None, anchors=32, seq=256,
                  corpus=None, max_bytes=6_000_000, steps=300, batch=8, lr=3e-3, warmup=20,
                  weight_decay=0.1, seed=0, save_every=50, resume=False, compile=False,
                  dtype="bfloat16", progress=True) -> dict:
    torch.manual_seed(seed)
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    target = Qwen3Model.from_pretrained(target_dir, dtype="float32")  # frozen (requires_grad off)
    net = _build_net(target_dir, tcfg, head=head, gamma=gamma, layers=layers, rank=rank,
                     target_layer_ids=target_layer_ids, confidence=confidence,
                     upgrade_dflash=upgrade_dflash)
    rotary = Rotary(target.config, torch.float32, "cpu")
    sample, L, info = _data(data, target_dir, corpus, max_bytes, seed, seq)
    gamma, frozen = net.cfg["block_size"], upgrade_dflash is not None

    def loss_of(seqs, anchor_pos):
        return drafter_loss(net, target, rotary, seqs, anchor_pos, frozen_backbone=frozen)

    fn = torch.compile(loss_of, dynamic=False) if compile else loss_of

    def step_fn(step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        seqs = sample(step, g, batch)
        return fn(seqs, sample_anchors(g, batch, anchors, L, gamma))

    summary = train_loop(net, step_fn, out=out, steps=steps, lr=lr, warmup=warmup,
                         weight_decay=weight_decay, save_every=save_every, resume=resume,
                         export=lambda: save_drafter(net, out, dtype),
                         desc=f"train drafter ({net.cfg.get('markov_head_type', 'dflash')})",
                         progress=progress)
    summary.update(info, params=sum(p.numel() for p in net.parameters()),
                   trainable=sum(p.numel() for p in net.parameters() if p.requires_grad),
                   head=head, gamma=gamma, upgrade_dflash=upgrade_dflash)
    return summary
