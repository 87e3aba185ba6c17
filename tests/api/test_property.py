"""Arbitrary SamplingParams, prompts and message lists thrown at one Decoder: each call either
raises a ValueError / TypeError naming the field or argument, or returns outputs that respect
max_tokens and the context; never another exception or a hang, the KV pool never grows past what
the requests' contexts need, and the Decoder then serves a good request exactly as before."""
import dataclasses
import re
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dspark_rt import Decoder, SamplingParams, testing

CTX = 48          # a short context keeps every example's decoding short
MAX_PROMPTS = 3
NAMED = re.compile(r"SamplingParams\.\w+|prompt|params|messages|chat|request \d+")
GOOD = ([5, 6, 7], dict(temperature=0, max_tokens=6))


@pytest.fixture(scope="module")
def dec(tmp_path_factory, tiny_target):
    path = tmp_path_factory.mktemp("ctx48")
    testing.write_tiny_target(path, seed=1, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2,
                              head_dim=16, max_position_embeddings=CTX)
    drafter = tmp_path_factory.mktemp("ctx48_drafter")
    testing.write_tiny_drafter(drafter, path, head="gated", markov_rank=8, confidence=True,
                               confidence_markov=True, layers=1, block_size=4,
                               target_layer_ids=[0], seed=7, share_target_layers=True)
    d = Decoder.from_pretrained(path, drafter, mode="dspark", policy="threshold", threshold=0.3)
    d.good_ids = d.generate([GOOD[0]], SamplingParams(**GOOD[1]), use_tqdm=False)[0].token_ids
    return d


junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
ints = st.one_of(st.integers(-3, 200), st.integers(-2**70, 2**70),
                 st.integers(0, 1000).map(np.int64), st.integers(0, 2**64 - 1).map(np.uint64))
reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 3),
                  st.floats(0, 3).map(np.float32), st.integers(-2, 5), st.just(0.0))
texts = st.text(st.characters(codec=None, blacklist_categories=()), max_size=6)  # surrogates too

PARAM_STRATEGIES = {
    "temperature": st.one_of(reals, junk), "top_p": st.one_of(reals, junk),
    "top_k": st.one_of(ints, junk), "seed": st.one_of(ints, junk),
    "max_tokens": st.one_of(ints, st.integers(1, 12), junk),
    "stop": st.one_of(junk, texts, st.lists(st.one_of(texts, st.integers()), max_size=3)),
    "stop_token_ids": st.one_of(junk, st.lists(ints, max_size=3)),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "logprobs": st.one_of(st.booleans(), st.none(), st.integers(-2, 25), junk),
    "coupled": st.one_of(st.booleans(), junk), "skip_special_tokens": st.one_of(st.booleans(), junk),
    "speculative": st.one_of(st.booleans(), junk),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 25), junk),
    "structured_outputs": st.one_of(st.none(), junk),
    "min_p": st.one_of(reals, junk), "min_tokens": st.one_of(ints, st.integers(0, 12), junk),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 95), ints),
                                                       max_size=4), junk),
    "bad_words": st.one_of(junk, st.lists(st.one_of(texts, st.integers()), max_size=3)),
}
params = st.fixed_dictionaries({}, optional=PARAM_STRATEGIES)
token_lists = st.lists(st.one_of(st.integers(0, 95), ints), max_size=60)
prompt = st.one_of(texts, st.text(max_size=40), token_lists, junk, st.integers())
prompts = st.one_of(prompt, st.lists(prompt, max_size=MAX_PROMPTS))
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5]),
                                           "content": st.one_of(texts, st.none(), st.integers())}),
                    junk)
messages = st.one_of(st.lists(message, max_size=3), st.lists(st.lists(message, max_size=2), max_size=2), junk)


def _check_good(dec):
    out = dec.generate([GOOD[0]], SamplingParams(**GOOD[1]), use_tqdm=False)[0]
    assert out.token_ids == dec.good_ids


def _check_outputs(dec, outs, sp):
    for o in outs:
        assert o.finish_reason in ("stop", "length"), (o.finish_reason, o.error)
        assert 1 <= len(o.token_ids) <= sp.max_tokens
        assert len(o.prompt_token_ids) + len(o.token_ids) <= CTX
    r = dec.runner
    per_request = CTX + 2 * r.page_size + r.block_size + r.gamma
    assert dec.engine.num_pages * r.page_size <= 1.1 * MAX_PROMPTS * per_request + r.page_size


def _call(dec, fn):
    """Runs fn(); a ValueError / TypeError must name what was wrong."""
    try:
        return fn()
    except (ValueError, TypeError) as e:
        assert NAMED.search(str(e)), f"{type(e).__name__} names no field: {e}"
        return None


@settings(max_examples=25, deadline=timedelta(seconds=60), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(kw=params, p=prompts, m=messages, use_chat=st.booleans())
def test_anything_in_either_a_named_error_or_a_result(dec, kw, p, m, use_chat):
    sp = _call(dec, lambda: SamplingParams(**kw))
    if sp is None:
        sp = SamplingParams(max_tokens=4)
    if use_chat:
        outs = _call(dec, lambda: dec.chat(m, sp, use_tqdm=False))
    else:
        outs = _call(dec, lambda: dec.generate(p, sp, use_tqdm=False))
    if outs is not None:
        _check_outputs(dec, outs, sp)
    _check_good(dec)


@settings(max_examples=10, deadline=timedelta(seconds=60), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kw=params, p=prompt)
def test_fields_set_after_construction_are_checked_when_queued(dec, kw, p):
    sp = SamplingParams(max_tokens=4)
    for name, value in kw.items():  # bypasses __post_init__: the engine must check again
        object.__setattr__(sp, name, value)
    outs = _call(dec, lambda: dec.generate([[5, 6]], sp, use_tqdm=False))
    if outs is not None:
        _check_outputs(dec, outs, sp)
    _check_good(dec)


def test_params_fields_are_all_thrown():
    """The strategy covers every field of SamplingParams (a new field must be added to it)."""
    assert set(PARAM_STRATEGIES) == {f.name for f in dataclasses.fields(SamplingParams)}
