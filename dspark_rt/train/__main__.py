"""`dspark-rt train <stage>` (or `python -m dspark_rt.train <stage>`): build a tiny model pair.

Stages, in pipeline order (scripts/make_tiny_pair.sh runs them all with fixed seeds):
  tokenizer  byte-level BPE on the corpus -> tokenizer folder
  target     pretrain a tiny Qwen3 target -> Hugging Face folder
  regen      target-generated continuations of corpus windows (drafter training data)
  drafter    train a DSpark (vanilla/gated/rnn head) or DFlash (--head none) drafter -> DeepSpec folder
  prompts    held-out corpus windows as a JSONL prompt file (for `dspark-rt calibrate`)
  heldout    a target's loss on the held-out corpus files (nats per token, bits per byte)
The corpus defaults to this interpreter's standard library (*.py, tests skipped).
"""
import argparse
import json
import sys

import torch

from ..tools.prompts import positive

__all__ = ["main"]


def _existing(s):
    """argparse type: a file or folder that exists."""
    from pathlib import Path
    if not Path(s).exists():
        raise argparse.ArgumentTypeError(f"{s}: no such file or folder")
    return s


def _layer_ids(s):
    """argparse type: comma-separated ints (target layer ids; -1 is the embedding output)."""
    try:
        ids = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {s!r}") from None
    if not ids or any(i < -1 for i in ids):
        raise argparse.ArgumentTypeError(f"must be ints >= -1, got {s!r}")
    return ids


def _corpus_args(p):
    p.add_argument("--corpus", type=_existing, help="folder of *.py files (default: the running Python's stdlib)")
    p.add_argument("--max-bytes", type=positive(int), default=6_000_000, help="cap on training text")


def _loop_args(p, steps, batch, lr, warmup):
    p.add_argument("--steps", type=positive(int), default=steps)
    p.add_argument("--batch", type=positive(int), default=batch, help="sequences per step")
    p.add_argument("--lr", type=positive(float), default=lr)
    p.add_argument("--warmup", type=positive(int, zero_ok=True), default=warmup)
    p.add_argument("--weight-decay", type=positive(float, zero_ok=True), default=0.1)
    p.add_argument("--save-every", type=positive(int), default=50, help="steps between resumable saves")
    p.add_argument("--resume", action="store_true", help="continue from <out>/train_state.pt")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the loss (about 2 min to compile; faster long runs)")
    p.add_argument("--threads", type=positive(int, zero_ok=True), default=0,
                   help="torch threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspark-rt train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)

    p = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=positive(int), default=2048)
    p.add_argument("--ctx", type=positive(int), default=512, help="model_max_length written to the config")
    p.add_argument("--seed", type=int, default=0)
    _corpus_args(p)

    p = sub.add_parser("target", help="pretrain the tiny Qwen3 target")
    p.add_argument("--tokenizer", required=True, type=_existing, help="folder written by the tokenizer stage")
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=positive(int), default=256)
    p.add_argument("--layers", type=positive(int), default=4)
    p.add_argument("--heads", type=positive(int), default=4)
    p.add_argument("--kv-heads", type=positive(int), default=2)
    p.add_argument("--head-dim", type=positive(int), default=64)
    p.add_argument("--intermediate", type=positive(int), default=768)
    p.add_argument("--ctx", type=positive(int), default=512)
    p.add_argument("--seq", type=positive(int), default=512, help="training sequence length")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the written weights")
    p.add_argument("--init", type=_existing, default=None,
                   help="a target folder to train further (its shape replaces the shape options)")
    p.add_argument("--unlikelihood", type=positive(float, zero_ok=True), default=0.0,
                   help="weight of the token-level unlikelihood term against repetition (0: off)")
    p.add_argument("--seq-unlikelihood", type=positive(float, zero_ok=True), default=0.0,
                   help="weight of the sequence-level unlikelihood term: the model's own greedy "
                        "continuations, their repeated 4-grams pushed down (0: off)")
    _corpus_args(p)
    _loop_args(p, steps=400, batch=8, lr=2e-3, warmup=30)

    p = sub.add_parser("regen", help="target-generated continuations (drafter training data)")
    p.add_argument("--target", required=True, type=_existing)
    p.add_argument("--out", required=True, help=".pt file")
    p.add_argument("--num", type=positive(int), default=1024, help="sequences")
    p.add_argument("--prompt-len", type=positive(int), default=128)
    p.add_argument("--new-tokens", type=positive(int), default=128)
    p.add_argument("--batch", type=positive(int), default=64)
    p.add_argument("--temperature", type=positive(float, zero_ok=True), default=0.8,
                   help="odd sequences are sampled at this temperature, even ones greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive(int, zero_ok=True), default=0)
    _corpus_args(p)

    p = sub.add_parser("drafter", help="train a DSpark or DFlash drafter against a frozen target")
    p.add_argument("--target", required=True, type=_existing)
    p.add_argument("--out", required=True)
    p.add_argument("--data", type=_existing, help="regen .pt file (default: corpus windows)")
    p.add_argument("--head", default="vanilla", choices=["vanilla", "gated", "rnn", "none"],
                   help="sequential head; none = DFlash")
    p.add_argument("--gamma", type=positive(int), default=7, help="block size (drafts per round)")
    p.add_argument("--layers", type=positive(int), default=1, help="drafter decoder layers")
    p.add_argument("--rank", type=positive(int), default=128, help="Markov rank r")
    p.add_argument("--target-layer-ids", default=None, type=_layer_ids,
                   help="comma-separated target layers for the context features "
                        "(default: evenly spaced, final layer excluded)")
    p.add_argument("--confidence", choices=["auto", "yes", "no"], default="auto",
                   help="confidence head (auto: with a sequential head only)")
    p.add_argument("--upgrade-dflash", metavar="DIR", type=_existing,
                   help="start from this DFlash drafter, freeze its backbone, train the heads")
    p.add_argument("--anchors", type=positive(int), default=32, help="anchors (blocks) per sequence")
    p.add_argument("--seq", type=positive(int), default=256, help="sequence length (corpus windows)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the written weights")
    _corpus_args(p)
    _loop_args(p, steps=300, batch=8, lr=3e-3, warmup=20)

    p = sub.add_parser("prompts", help="held-out corpus windows as a JSONL prompt file")
    p.add_argument("--out", required=True)
    p.add_argument("--num", type=positive(int), default=64)
    p.add_argument("--chars", type=positive(int), default=600, help="characters per prompt (about)")
    p.add_argument("--seed", type=int, default=0)
    _corpus_args(p)

    p = sub.add_parser("heldout", help="a target's loss on the held-out corpus files")
    p.add_argument("--target", required=True, type=_existing)
    p.add_argument("--seq", type=positive(int), default=512, help="tokens per scored window")
    p.add_argument("--corpus", type=_existing, help="folder of *.py files (default: the running Python's stdlib)")
    p.add_argument("--seed", type=int, default=0, help="the corpus shuffle seed of the training run")
    p.add_argument("--threads", type=positive(int, zero_ok=True), default=0,
                   help="torch threads (0: leave as is)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if getattr(a, "threads", 0):
        torch.set_num_threads(a.threads)
    try:
        s = _run(a)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a bad file or setting: one line, not a traceback
        ap.exit(2, f"dspark-rt train {a.stage}: error: {_reason(e)}\n")
    print(json.dumps({"stage": a.stage, "out": getattr(a, "out", None), **s}, indent=2, default=str))
    return 0


def _reason(e: Exception) -> str:
    if isinstance(e, (ValueError, OSError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _run(a) -> dict:
    if a.stage == "tokenizer":
        from .corpus import load_corpus
        from .tokenizer_train import save_tokenizer, train_tokenizer
        data = load_corpus(a.corpus, max_bytes=a.max_bytes, seed=a.seed)
        tok = train_tokenizer(data.train, a.vocab)
        save_tokenizer(tok, a.out, a.ctx)
        s = {"vocab": tok.get_vocab_size(), "files": len(data.train),
             "train_bytes": data.train_bytes, "corpus": data.root}
    elif a.stage == "target":
        from .pretrain import pretrain
        s = pretrain(tokenizer_dir=a.tokenizer, out=a.out, corpus=a.corpus, max_bytes=a.max_bytes,
                     hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                     head_dim=a.head_dim, intermediate=a.intermediate, ctx=a.ctx, steps=a.steps,
                     batch=a.batch, seq=a.seq, lr=a.lr, warmup=a.warmup,
                     weight_decay=a.weight_decay, seed=a.seed, save_every=a.save_every,
                     resume=a.resume, compile=a.compile, dtype=a.dtype, init=a.init,
                     unlikelihood=a.unlikelihood, seq_unlikelihood=a.seq_unlikelihood)
    elif a.stage == "regen":
        from .regen import regenerate
        s = regenerate(a.target, a.out, corpus=a.corpus, max_bytes=a.max_bytes, num=a.num,
                       prompt_len=a.prompt_len, new_tokens=a.new_tokens, batch=a.batch,
                       temperature=a.temperature, seed=a.seed)
    elif a.stage == "drafter":
        from .drafter_train import train_drafter
        ids = a.target_layer_ids
        conf = {"auto": None, "yes": True, "no": False}[a.confidence]
        s = train_drafter(target_dir=a.target, out=a.out, data=a.data, head=a.head, gamma=a.gamma,
                          layers=a.layers, rank=a.rank, target_layer_ids=ids, confidence=conf,
                          upgrade_dflash=a.upgrade_dflash, anchors=a.anchors, seq=a.seq,
                          corpus=a.corpus, max_bytes=a.max_bytes, steps=a.steps, batch=a.batch,
                          lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay, seed=a.seed,
                          save_every=a.save_every, resume=a.resume, compile=a.compile,
                          dtype=a.dtype)
    elif a.stage == "heldout":
        from .heldout import heldout_loss
        s = heldout_loss(a.target, corpus=a.corpus, seed=a.seed, seq=a.seq)
    else:
        from .regen import write_prompts
        s = write_prompts(a.out, corpus=a.corpus, max_bytes=a.max_bytes, num=a.num,
                          chars=a.chars, seed=a.seed)
    return s


if __name__ == "__main__":
    sys.exit(main())
