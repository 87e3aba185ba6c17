"""Training text: by default the Python standard-library sources of the running interpreter.

Files are listed in sorted order, shuffled with a fixed seed (so a byte cap samples the whole
library rather than its first packages alphabetically) and split deterministically: every
`holdout_every`-th file of that order is held out (calibration prompts, never trained on).
Test suites, site-packages, generated tables and very large files are skipped.
"""
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "stdlib_dir", "list_files", "load_corpus", "TokenStream"]

# folders that are test suites, third-party code, generated data or demos, not library code
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "encodings", "pydoc_data", "turtledemo", "ensurepip", "lib2to3"}
_MAX_FILE_BYTES = 200_000
EOT = "<|endoftext|>"


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_files(root) -> list[Path]:
    """*.py files under root in sorted relative-path order, minus skipped folders and files."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _SKIP_DIRS and not d.startswith(("config-", "plat-")))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if f.endswith(".py") and not f.startswith(("test_", "_sysconfigdata")) and \
                    p.stat().st_size <= _MAX_FILE_BYTES:
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class Corpus:
    root: str
    train: list[str]     # file texts, in order
    heldout: list[str]
    train_files: list[str]
    heldout_files: list[str]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train)


def load_corpus(root=None, max_bytes: int = 6_000_000, seed: int = 0,
                holdout_every: int = 25) -> Corpus:
    """Reads up to max_bytes of training text (held-out files do not count)."""
    root = Path(root or stdlib_dir())
    files = list_files(root)
    if not files:
        raise ValueError(f"{root}: no *.py files to train on")
    random.Random(seed).shuffle(files)
    train, heldout, tf, hf, total = [], [], [], [], 0
    for i, p in enumerate(files):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        name = p.relative_to(root).as_posix()
        if i % holdout_every == 0:
            heldout.append(text)
            hf.append(name)
            continue
        if total >= max_bytes:
            continue
        train.append(text)
        tf.append(name)
        total += len(text.encode())
    return Corpus(str(root), train, heldout, tf, hf)


class TokenStream:
    """Documents tokenized and joined with <|endoftext|> into one int32 stream; batches are
    random windows drawn from a generator seeded by (seed, step), so a resumed run sees the same
    batches it would have seen without the interruption."""

    def __init__(self, texts: list[str], tokenizer, eot_id: int):
        enc = tokenizer.encode_batch(texts)
        ids = []
        for e in enc:
            ids.extend(e.ids)
            ids.append(eot_id)
        self.ids = torch.tensor(ids, dtype=torch.int64)

    def __len__(self):
        return len(self.ids)

    def batch(self, step: int, seed: int, B: int, L: int) -> torch.Tensor:
        """[B, L] windows for this step."""
        if len(self.ids) <= L:
            raise ValueError(f"the corpus has {len(self.ids)} tokens, not more than one window "
                             f"of {L}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - L, (B,), generator=g)
        return torch.stack([self.ids[s: s + L] for s in starts.tolist()])
