"""dspark_rt/structured: the request parameters, xgrammar's compiled grammars on our tokenizer,
and the verify walk (masks per row, the stop at a refused draft, the rollback)."""
import numpy as np
import pytest
import torch

from dspark_rt.checkpoint.tokenizer import Tokenizer
from dspark_rt.ops import reference
from dspark_rt.structured import Constraints, StructuredOutputsParams as S
from dspark_rt.structured.grammar import choice_regex, grammar_book

from tests.support.shipped_pair import TARGET

V = 2048  # the shipped target's vocabulary


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(str(TARGET))


@pytest.fixture(scope="module")
def book(tok):
    return grammar_book(tok, V)


@pytest.mark.parametrize("kw,match", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json": 3}, "json must be"), ({"json": "{bad"}, "json is not valid JSON"),
    ({"json": {"type": "objectx"}}, r"json: Unsupported type"),
    ({"regex": "(ab"}, "regex: Regex parsing error"), ({"grammar": "root ::= foo"}, r"grammar: .*foo"),
    ({"choice": []}, "choice must be"), ({"choice": ["a", ""]}, "choice must be")])
def test_bad_params_name_the_field_before_any_work(kw, match):
    with pytest.raises(ValueError, match=match):
        S(**kw)


def test_cache_per_grammar_and_tokenizer(tok, book):
    a, b = S(json={"type": "object", "required": ["x"]}), S(json='{"required": ["x"], "type": "object"}')
    assert a.key() == b.key() and book.compile(a) is book.compile(b)
    assert grammar_book(tok, V) is book and grammar_book(tok, V + 64) is not book


def _allowed(m):
    row = np.zeros((V + 31) // 32, dtype=np.int32)
    m.fill(row)
    return set(reference.allowed(torch.from_numpy(row)[None], V)[0].nonzero()[:, 0].tolist())


def test_masks_follow_the_tokenizer(tok, book):
    """The start mask of a choice list allows exactly the tokens that begin one of its strings;
    after the whole string only a stop token remains."""
    choices = ["return self", "pass"]
    m = book(S(choice=choices), V)
    ok = _allowed(m)
    texts = {t: tok.decode([t]) for t in ok}
    assert ok and all(any(c.startswith(s) for c in choices) and s for s in texts.values()), texts
    for t in tok.encode("pass", add_special_tokens=False):
        assert m.accept(t)
    assert _allowed(m) <= set(tok.eos_token_ids) and _allowed(m)
    assert choice_regex(["a.b", "(c)"]) == r"a\.b|\(c\)"


class _Spec:
    sampling = None


def test_walk_masks_rows_stops_at_refusal_and_rolls_back(tok, book):
    """Row k carries the state after x_1 .. x_k; the walk stops at the first refused draft,
    leaves later rows all ones, and the matcher returns to its committed state."""
    good = tok.encode("return self", add_special_tokens=False)
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    spec = S(choice=["return self", "pass"])
    c = Constraints(book)
    ref = book(spec, V)
    m = book(spec, V)
    start = _allowed(m)
    drafts = good[:2] + [bad] + good[2:3]
    masks = c.verify_masks([m], [drafts + [0] * 3], [len(drafts)], V, "cpu")
    assert masks.shape == (len(drafts) + 1, (V + 31) // 32)
    rows = reference.allowed(masks, V)
    assert set(rows[0].nonzero()[:, 0].tolist()) == start
    for k in range(2):
        ref.accept(good[k])
        assert set(rows[k + 1].nonzero()[:, 0].tolist()) == _allowed(ref)
    assert rows[3:].all()  # after the refused draft: no mask
    assert _allowed(m) == start  # rolled back to the committed prefix
    c.matchers["r"] = m
    c.commit(["r"], [m], [good + [-1]], [len(good) - 1], [False])
    assert "r" in c.matchers and _allowed(m) <= set(tok.eos_token_ids)


class _Batch:
    def __init__(self, ids, specs):
        self.ids = ids
        self.sampling = type("S", (), {"structured_outputs": specs})()


def test_completed_grammar_is_not_restarted(tok, book):
    """After the grammar completes (its stop token emitted; a request that ignores eos decodes
    on), the request keeps its matcher: no mask, never the grammar again from its start."""
    c = Constraints(book)
    batch = _Batch(["r"], [S(choice=["pass"])])
    (m,) = c.of(batch, V)
    toks = tok.encode("pass", add_special_tokens=False) + [tok.eos_token_ids[0]]
    c.commit(["r"], [m], [toks], [len(toks) - 1], [False])
    assert m.terminated and c.of(batch, V) == [m]
    assert bool((c.first_masks([m], V, "cpu") == -1).all())
    c.drop("r")
    assert c.of(batch, V)[0] is not m


def test_complete_means_a_whole_match_so_far(tok, book):
    """complete: the text is a whole match (its stop token taken, or allowed next); a prefix of
    a match is not complete. The engine reports it as grammar_complete."""
    c = Constraints(book)
    (m,) = c.of(_Batch(["r"], [S(choice=["pass", "passed"])]), V)
    first, *rest = tok.encode("pass", add_special_tokens=False)
    assert rest and c.complete("r") is False and c.complete("other") is None
    assert m.accept(first) and c.complete("r") is False  # a prefix of "pass"
    for t in rest:
        assert m.accept(t)
    assert c.complete("r") and not m.terminated  # "pass" matches; "passed" may still follow
    assert m.accept(tok.eos_token_ids[0]) and m.terminated and c.complete("r")
