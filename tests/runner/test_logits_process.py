"""The logits processors of the target's rows (dspark_rt/runner/logits_process.py) and their
SamplingParams / SamplingBatch fields: each verify row masked with its own context (the emitted
tokens, then the drafts before it), against a plain Python reference on random chains."""
import random

import pytest
import torch

from dspark_rt import SamplingParams
from dspark_rt.batch import SamplingBatch
from dspark_rt.checkpoint.tokenizer import Tokenizer
from dspark_rt.runner.logits_process import ban_bad_words, filter_rows, mask_rows
from tests.support.shipped_pair import TARGET


def _banned_reference(n, words, recent, drafts):
    """{(row, token)} banned: row k's context is recent + drafts[:k]."""
    out = set()
    for k in range(n):
        ctx = list(recent) + list(drafts[:k])
        for *prefix, last in words:
            if not prefix or (len(ctx) >= len(prefix) and ctx[len(ctx) - len(prefix):] == prefix):
                out.add((k, last))
    return out


@pytest.mark.parametrize("trial", range(40))
def test_bad_words_read_each_rows_chain(trial):
    rng = random.Random(trial)
    V, n = 6, rng.randint(1, 5)
    recent = [rng.randrange(V) for _ in range(rng.randint(0, 3))]
    drafts = [rng.randrange(V) for _ in range(n - 1)]
    words = [[rng.randrange(V) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
    rows = torch.zeros(n, V)
    ban_bad_words(rows, words, recent, torch.tensor(drafts, dtype=torch.int64) if drafts else None)
    got = {(k, t) for k in range(n) for t in range(V) if rows[k, t] == float("-inf")}
    assert got == _banned_reference(n, words, recent, drafts), (words, recent, drafts)


def test_a_two_token_word_whose_first_token_is_a_draft():
    rows = torch.zeros(3, 8, dtype=torch.bfloat16)  # anchor 1, drafts 4 then 2
    ban_bad_words(rows, [[4, 2]], [1], torch.tensor([4, 2]))
    assert torch.isinf(rows[1, 2]) and torch.isfinite(rows[0]).all() and torch.isfinite(rows[2]).all()


def test_min_tokens_masks_the_rows_before_the_count():
    rows = torch.zeros(4, 5)
    # 2 tokens out, min 4: rows 0 and 1 emit tokens 3 and 4, still masked; rows 2, 3 free
    mask_rows(rows, None, [], [], None, min_tokens=4, emitted=2, min_stop=[1, 3])
    assert torch.isinf(rows[:2, [1, 3]]).all() and torch.isfinite(rows[2:]).all()
    assert torch.isfinite(rows[:, [0, 2, 4]]).all()


def test_allowed_token_ids_keep_only_those():
    rows = torch.randn(3, 6)
    mask_rows(rows, [1, 4], [], [], None, 0, 0, [])
    assert torch.isfinite(rows[:, [1, 4]]).all() and torch.isinf(rows[:, [0, 2, 3, 5]]).all()


def test_min_p_drops_below_a_share_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    kept = filter_rows(logits, 0, 1.0, min_p=0.3)  # threshold 0.15: 0.15 stays
    assert torch.isfinite(kept[0, :3]).all() and torch.isinf(kept[0, 3])


@pytest.mark.parametrize("field,value", [
    ("min_p", 1.5), ("min_p", -0.1), ("min_p", "x"), ("min_tokens", -1), ("min_tokens", 2.0),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -2]), ("allowed_token_ids", 3),
    ("bad_words", "word"), ("bad_words", [" "]), ("bad_words", [3]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_at_most_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_bad_words_tokenized_alone_and_after_a_space():
    tok = Tokenizer(str(TARGET))
    p = SamplingParams(bad_words=["method", "methodmethod"])
    p.update_from_tokenizer(tok, 2048)
    words = p.bad_words_token_ids
    for w in ("method", " method", "methodmethod"):
        ids = tok.encode(w, add_special_tokens=False)
        assert ids in words, (w, ids, words)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None, 2048)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 2048]).update_from_tokenizer(tok, 2048)


def test_sampling_batch_carries_the_context_bad_words_need():
    p = SamplingParams(temperature=0)
    p._bad_words_token_ids = [[1, 2, 3], [4]]  # the longest needs two tokens of context
    q = SamplingParams(temperature=0, allowed_token_ids=[1], min_p=0.5)
    b = SamplingBatch.of([p, p, q, SamplingParams(temperature=0, min_p=0.5)],
                         [[9], [7, 8, 9], [], [5]], eos_token_ids=[0])
    assert b.recent == [[9], [8, 9], [], []] and b.emitted == [1, 3, 0, 1]
    assert b.filtered == [True, True, True, False]  # greedy: min_p changes no argmax
    assert b.min_stop[0] == [0]
    assert SamplingBatch.of([SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[3])],
                            [[1]], [0]).min_stop == [[3]]
