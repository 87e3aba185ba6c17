"""The shipped trained pair (dspark_rt/pretrained) and the prompts the greedy lossless suite
decodes on it, with the two checks every greedy case makes: equal to plain decoding, and how
deeply drafts were accepted. Shared by tests/e2e/test_lossless.py and the tests that reuse its
pair (DFlash2, packagings, the auto policy, the plain-request switch)."""
from pathlib import Path

PAIR = Path(__file__).resolve().parents[2] / "dspark_rt" / "pretrained"
TARGET = PAIR / "target"
DRAFTERS = {"vanilla": PAIR / "dspark", "gated": PAIR / "dspark_gated", "rnn": PAIR / "dspark_rnn",
            "none": PAIR / "dflash"}
# Code the target was not trained on (it saw the standard library; these are written here),
# chosen from 36 candidates as the ones its drafters accept most deeply (2026-12-02: the target
# no longer falls into greedy loops, so no prompt here has drafts accepted whole block after
# block; the first is one of the few with whole blocks at all, for the batch-1 cases).
PROMPTS = [
    "def __eq__(self, other):\n    if not isinstance(other, type(self)):\n        return NotImplemented\n",
    "class Error(Exception):\n    pass\n\n\nclass ",
    "# Copyright (c) the authors.\n\"\"\"Utilities for parsing configuration files.\"\"\"\n",
    "    def __repr__(self):\n        return ",
    "import os\nimport sys\n\n__all__ = [",
    "A = 1\nB = 2\nC = 3\nD = 4\nE = 5\n",
    "    def __getitem__(self, key):\n        return self._data[key]\n\n"
    "    def __setitem__(self, key, value):\n",
    "    def close(self):\n        ",
]
MAX_TOKENS = 48


def check_equal(outs, ref, dtype):
    """Each output's tokens equal plain decoding's (ref, in PROMPTS order), else the first
    position where they differ."""
    for prompt, o, want in zip(PROMPTS, outs, ref):
        if o.token_ids != want:
            i = next((i for i, (a, b) in enumerate(zip(o.token_ids, want)) if a != b), len(want))
            raise AssertionError(f"{prompt!r}: differs from plain decoding in {dtype} at {i}")


def acceptance(outs):
    """(mean acceptance length tau, share of rounds accepting the whole block, share of the
    drafts that were verified) over the outputs' rounds."""
    rounds = sum(o.metrics.num_rounds for o in outs)
    acc = sum(o.metrics.num_accepted_tokens for o in outs)
    full = sum(o.metrics.acceptance_histogram[-1] for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    gamma = outs[0].metrics.gamma
    return (acc + rounds) / rounds, full / rounds, drafted / (rounds * gamma)
