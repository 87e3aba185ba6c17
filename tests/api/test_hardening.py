"""What a careless or hostile user of the public API must not be able to break: memory sized by
the context, failed allocations, stop strings, vocabulary checks, metrics after a stop, special
tokens, temperature range, field-naming validation, constructor values, errors, threads."""
import json
import math
import shutil
import threading

import numpy as np
import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.engine import EngineConfig
from dspark_rt.engine.engine import Engine
from dspark_rt.checkpoint.tokenizer import Tokenizer

PRETRAINED = __import__("pathlib").Path(__file__).resolve().parents[2] / "dspark_rt" / "pretrained"
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def shipped():
    """The shipped pair (context 512, gamma 7), dspark with the fixed policy."""
    return Decoder.from_pretrained(PRETRAINED / "target", PRETRAINED / "dspark")


@pytest.fixture(scope="module")
def tiny(tiny_target, tiny_drafters):
    return Decoder.from_pretrained(tiny_target, tiny_drafters("gated", 4), mode="dspark")


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A tiny dspark pair whose context is 48 positions: outputs that run to the context stay short."""
    from dspark_rt import testing
    target, drafter = tmp_path_factory.mktemp("ctx48"), tmp_path_factory.mktemp("ctx48_drafter")
    testing.write_tiny_target(target, seed=1, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2,
                              head_dim=16, max_position_embeddings=48)
    testing.write_tiny_drafter(drafter, target, head="gated", markov_rank=8, layers=1,
                               block_size=4, target_layer_ids=[0], seed=7, share_target_layers=True)
    return Decoder.from_pretrained(target, drafter, mode="dspark")


def _gen(dec, prompt, **kw):
    return dec.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def _pool_positions(dec) -> int:
    return dec.engine.num_pages * dec.runner.page_size


# -- 1. max_tokens is capped by the context ---------------------------------------------------

@pytest.mark.parametrize("max_tokens", [100_000, 10_000_000, 2**70])
def test_max_tokens_beyond_context_holds_only_the_context(short, max_tokens):
    prompt = [5, 6, 7]
    out = _gen(short, prompt, max_tokens=max_tokens, ignore_eos=True, **GREEDY)
    ctx = short.max_model_len
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == ctx
    assert out.token_ids == _gen(short, prompt, max_tokens=ctx - len(prompt), ignore_eos=True,
                                 **GREEDY).token_ids
    # the pool holds one request's context (plus a round's chain and the watermark), not max_tokens
    assert _pool_positions(short) <= 1.1 * (ctx + 2 * short.runner.page_size + short.runner.block_size)


def test_engine_accepts_max_tokens_beyond_a_small_pool(short):
    ctx, ps = short.max_model_len, short.runner.page_size
    pages = (ctx + 2 * ps + short.runner.block_size) // ps + 1  # one whole context fits
    eng = short.new_engine(EngineConfig(num_pages=pages, max_num_seqs=2))
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4 * ctx, **GREEDY))
    while eng.has_unfinished():
        eng.step()
    assert rid not in eng.requests


def test_stream_pool_is_bounded_by_the_context(tiny_target):
    dec = Decoder.from_pretrained(tiny_target)
    outs = list(dec.stream([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY)))
    assert outs[-1].finished
    ctx, ps = dec.max_model_len, dec.runner.page_size
    assert _pool_positions(dec) <= ctx + 2 * ps


# -- 2. a failed KV allocation leaves a working Decoder --------------------------------------

def test_failed_allocation_leaves_a_decoder_that_serves(tiny_target, tiny_drafters, monkeypatch):
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), mode="dspark")
    want = _gen(dec, [5, 6, 7], max_tokens=6, **GREEDY).token_ids

    def boom(*a, **k):
        raise MemoryError("no room")
    monkeypatch.setattr(dec.drafter, "make_cache", boom)
    with pytest.raises(MemoryError):
        _gen(dec, [5, 6, 7], max_tokens=200, **GREEDY)  # a bigger pool: reallocation fails half-way
    monkeypatch.undo()
    assert _gen(dec, [5, 6, 7], max_tokens=6, **GREEDY).token_ids == want


# -- 3. a stop string at the very start -------------------------------------------------------

def test_stop_string_at_the_start_gives_empty_text(shipped):
    full = _gen(shipped, "def f(x):", max_tokens=8, **GREEDY)
    assert full.text.startswith("\n")  # the greedy continuation opens with a newline
    out = _gen(shipped, "def f(x):", max_tokens=8, stop=["\n"], **GREEDY)
    assert out.finish_reason == "stop"
    assert out.text == ""


# -- 4. token ids beyond the model's vocabulary -----------------------------------------------

@pytest.fixture(scope="module")
def big_tokenizer_target(tmp_path_factory, tiny_target):
    """The tiny target (vocab 96) with the shipped 2048-token tokenizer."""
    path = tmp_path_factory.mktemp("bigtok")
    for f in tiny_target.iterdir():
        shutil.copy(f, path / f.name)
    shutil.copy(PRETRAINED / "target" / "tokenizer.json", path / "tokenizer.json")
    return path


def test_tokenizer_larger_than_vocab_is_refused_at_load(big_tokenizer_target):
    with pytest.raises(ValueError, match=r"tokenizer\.json.*(2048|vocab)"):
        Decoder.from_pretrained(big_tokenizer_target)


def test_text_prompt_with_ids_beyond_vocab_is_refused(tiny, big_tokenizer_target):
    tok = Tokenizer.from_pretrained(big_tokenizer_target)
    eng = Engine(tiny.runner, EngineConfig(num_pages=64), tokenizer=tok)
    with pytest.raises(ValueError, match="request 0.*vocab|request 0.*token ids"):
        eng.add_request("zzz qqq xyzzy", SamplingParams(max_tokens=2))
    good = eng.add_request([5, 6], SamplingParams(max_tokens=3, **GREEDY))
    while eng.has_unfinished():
        eng.step()
    assert good not in eng.requests


# -- 5. speculative metrics stop where the output stops ---------------------------------------

def test_metrics_count_only_emitted_tokens(shipped):
    prompt = "def f(x):"
    ids = _gen(shipped, prompt, max_tokens=30, **GREEDY).token_ids
    firsts = [k for k in range(1, len(ids)) if ids.index(ids[k]) == k][:8]
    for k in firsts:  # stops inside accepted runs and at round ends alike
        out = _gen(shipped, prompt, max_tokens=30, stop_token_ids=[ids[k]], **GREEDY)
        assert len(out.token_ids) == k + 1
        m = out.metrics
        # round 0 emits one token; every later round emits accepted + 1
        assert 1 + m.num_rounds + m.num_accepted_draft_tokens == len(out.token_ids), k
        assert sum(m.acceptance_histogram) == m.num_rounds
        assert m.num_accepted_draft_tokens <= m.num_draft_tokens
        assert all(a <= v for a, v in zip(m.num_accepted_tokens_per_pos, m.verified_by_position))


# -- 6. special tokens are not in the text by default -----------------------------------------

def test_special_tokens_skipped_in_text(tiny_target):
    dec = Decoder.from_pretrained(tiny_target)
    tok = dec.tokenizer
    special = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")}
    out = _gen(dec, [5, 6, 7], max_tokens=80, temperature=1.0, seed=3, ignore_eos=True)
    assert special & set(out.token_ids), "the test needs a special token in the output"
    assert "<|" not in out.text
    raw = _gen(dec, [5, 6, 7], max_tokens=80, temperature=1.0, seed=3, ignore_eos=True,
               skip_special_tokens=False)
    assert raw.token_ids == out.token_ids and "<|" in raw.text


# -- 7. temperatures beyond float32 ------------------------------------------------------------

@pytest.mark.parametrize("t", [1e39, 1e300, float(np.finfo(np.float32).max) * 2])
def test_temperature_beyond_float32_is_refused(t):
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("t", [1e30, float(np.finfo(np.float32).max)])
@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-9)])
def test_largest_temperature_keeps_top_k_and_top_p(short, t, filt):
    out = _gen(short, [5, 6, 7], max_tokens=8, temperature=t, seed=1, ignore_eos=True, **filt)
    greedy = _gen(short, [5, 6, 7], max_tokens=8, ignore_eos=True, **GREEDY)
    assert out.token_ids == greedy.token_ids  # top-k 1 / tiny top-p are greedy at any temperature


# -- 11. stop strings need a tokenizer ---------------------------------------------------------

def test_stop_strings_without_tokenizer_are_refused(tiny):
    eng = Engine(tiny.runner, EngineConfig(num_pages=64), tokenizer=None)
    with pytest.raises(ValueError, match="SamplingParams.stop.*tokenizer"):
        eng.add_request([5, 6], SamplingParams(stop=["x"]))


# -- 12. validation names the field --------------------------------------------------------------

@pytest.mark.parametrize("prompts", [None, 5, {"a": 1}, 3.5, [None], [[1, "a"]]])
def test_bad_prompts_name_the_argument(tiny, prompts):
    with pytest.raises((ValueError, TypeError), match="prompt"):
        tiny.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)


def test_lone_surrogate_prompt_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="request 0.*prompt"):
        tiny.generate(["ab\ud800cd"], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("stop", [5, {"a": 1}, [5], ["a", None]])
def test_bad_stop_names_the_field(stop):
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=stop)


def test_stop_none_means_no_stop():
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


@pytest.mark.parametrize("field,value", [
    ("temperature", np.float32(0.5)), ("temperature", np.int64(1)), ("top_p", np.float32(0.9)),
    ("top_k", np.int32(5)), ("seed", np.uint64(2**63 + 5)), ("seed", np.int64(7)),
    ("max_tokens", np.int64(4)),
])
def test_numpy_scalars_are_accepted(tiny, field, value):
    sp = SamplingParams(**{field: value})
    out = tiny.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert out.token_ids


def test_numpy_seed_draws_like_the_int(tiny):
    a = _gen(tiny, [5, 6], max_tokens=5, temperature=1.0, seed=2**63 + 5)
    b = _gen(tiny, [5, 6], max_tokens=5, temperature=1.0, seed=np.uint64(2**63 + 5))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("messages", [{"role": "user", "content": "hi"}, [], [[]], "hi", [5],
                                      [{"role": "user"}]])
def test_bad_chat_messages_name_the_argument(tiny, messages):
    with pytest.raises((ValueError, TypeError), match="messages|chat template"):
        tiny.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_stream_checks_arguments_at_the_call(tiny):
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        tiny.stream([5, 6], 5)
    with pytest.raises(ValueError, match="prompt"):
        tiny.stream([], SamplingParams(max_tokens=2))


# -- 13. constructor values ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(seed="x"), "seed"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(calibration=[1.0]), "calibration"), (dict(calibration=[1.0, 0.0, 1.0, 1.0]), "calibration"),
    (dict(calibration=[1.0, -2.0, 1.0, 1.0]), "calibration"),
    (dict(policy="threshold", threshold="x"), "threshold"),
    (dict(policy="threshold", threshold=float("nan")), "threshold"),
])
def test_bad_constructor_values_fail_at_construction(tiny_target, tiny_drafters, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Decoder.from_pretrained(tiny_target, tiny_drafters("gated", 4), mode="dspark", **kwargs)


def test_numpy_seed_in_constructor_draws_like_the_int(tiny_target):
    """Decoder(seed=np.int64(3)) keys the requests without a seed of their own as seed=3 does."""
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def draws(seed):
        dec = Decoder.from_pretrained(tiny_target, seed=seed)
        return dec.seed, dec.generate([[5, 6, 7]], p, use_tqdm=False)[0].token_ids

    seed, got = draws(np.int64(3))
    assert type(seed) is int and seed == 3
    assert got == draws(3)[1]
    assert got != draws(np.int64(4))[1], "the constructor's seed must key the draws"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_gpu_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="cuda"):
        Decoder.from_pretrained(tiny_target, device="cuda")


@pytest.mark.parametrize("policy", ["threshold", "sync", "async"])
def test_confidence_policy_without_confidence_head_is_refused(policy):
    with pytest.raises(ValueError, match="confidence"):
        Decoder.from_pretrained(PRETRAINED / "target", PRETRAINED / "dflash", policy=policy,
                                sps={"B": [1, 2], "sps": [1.0, 1.0]})


# -- 14. errors carry their reason --------------------------------------------------------------

def test_nan_weights_end_with_an_error_message(tiny_target):
    dec = Decoder.from_pretrained(tiny_target)
    with torch.no_grad():
        dec.target.norm.weight.fill_(float("nan"))
    out = _gen(dec, [5, 6, 7], max_tokens=4, **GREEDY)
    assert out.finish_reason == "error"
    assert out.error and "NaN" in out.error


# -- 15. several threads on one Decoder -----------------------------------------------------------

def test_threads_share_one_decoder(tiny_target, tiny_drafters):
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), mode="dspark")
    jobs = [([5, 6, 7], SamplingParams(max_tokens=12, **GREEDY)),
            ([9, 10], SamplingParams(max_tokens=30, temperature=0.8, seed=4)),
            ([11, 12, 13, 14], SamplingParams(max_tokens=20, temperature=1.0, seed=9, top_k=5)),
            ([20] * 40, SamplingParams(max_tokens=60, **GREEDY)),
            ([21, 22], SamplingParams(max_tokens=8, stop_token_ids=[7], **GREEDY)),
            ([30, 31, 32], SamplingParams(max_tokens=25, temperature=0.5, seed=1))]
    alone = [dec.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in jobs]
    got, errors = [None] * len(jobs), []

    def work(i):
        try:
            p, sp = jobs[i]
            for _ in range(2):
                got[i] = dec.generate([p], sp, use_tqdm=False)[0].token_ids
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert got == alone


def test_request_too_big_for_a_busy_pool_runs_after_the_others(tiny_target):
    dec = Decoder.from_pretrained(tiny_target)
    dec.generate([[5, 6]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)  # a small pool
    eng = dec.engine
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))  # keeps it busy
    out = _gen(dec, [20] * 40, max_tokens=300, ignore_eos=True, **GREEDY)
    assert len(out.token_ids) == 300
    assert rid not in eng.requests  # it ran to the end first
