"""Public API: sampling parameters, bad input, determinism, stops, log-probabilities, metrics."""
import math

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from tests.support.helpers import full_forward_logits
from tests.support.shipped_pair import DRAFTERS, TARGET

PROMPTS = [[5, 6, 7], [11], [20, 21, 22, 23, 24, 25]]
PROMPT_TEXT = "def parse_args(argv):\n"


@pytest.fixture(scope="module")
def dec(tiny_target, tiny_drafters):
    return Decoder.from_pretrained(tiny_target, tiny_drafters("gated", 4), mode="dspark")


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", 1e-5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("seed", -1), ("seed", 2**64),
    ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-3]), ("logprobs", -1),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"), ([1, 2, 10**6], r"token ids must lie in"), ([1, -1], r"token ids must lie in"),
    ("text", None), (3.5, "prompt must be"),
])
def test_bad_prompt_is_rejected_before_any_work(dec, prompt, match):
    if match is None:  # a text prompt is fine: the tiny target ships a tokenizer
        dec.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
        return
    with pytest.raises(ValueError, match=match) as err:
        dec.generate([[1, 2], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "request 1" in str(err.value)
    # the decoder keeps working for good requests afterwards
    assert len(dec.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids) == 3


def test_prompt_longer_than_context(dec):
    n = dec.max_model_len
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dec.generate([[1] * n], SamplingParams(max_tokens=2), use_tqdm=False)


def test_bad_stop_token_and_params_count(dec):
    with pytest.raises(ValueError, match="stop_token_ids"):
        dec.generate([[1]], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="params has 2 entries"):
        dec.generate([[1]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_bad_decoder_arguments(tiny_target, tiny_drafters):
    with pytest.raises(ValueError, match="mode"):
        Decoder.from_pretrained(tiny_target, mode="eagle")
    with pytest.raises(ValueError, match="needs a drafter"):
        Decoder.from_pretrained(tiny_target, mode="dspark")
    with pytest.raises(ValueError, match="dtype"):
        Decoder.from_pretrained(tiny_target, dtype="int8")
    with pytest.raises(ValueError, match="policy"):
        Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), policy="oracle")
    with pytest.raises(ValueError, match="confidence head"):
        Decoder.from_pretrained(tiny_target, tiny_drafters("zlab", 4), mode="dspark", policy="threshold")


def test_seeded_sampling_is_deterministic_and_batch_order_free(dec):
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    a = [o.token_ids for o in dec.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.token_ids for o in dec.generate(PROMPTS, params, use_tqdm=False)]
    assert a == b
    perm = [2, 0, 1]
    c = [o.token_ids for o in dec.generate([PROMPTS[i] for i in perm], [params[i] for i in perm],
                                           use_tqdm=False)]
    assert c == [a[i] for i in perm]
    # a different seed changes the tokens (a fixed stream would be a silent bug)
    d = dec.generate(PROMPTS[:1], SamplingParams(temperature=0.8, seed=999, max_tokens=12,
                                                 ignore_eos=True), use_tqdm=False)[0].token_ids
    assert d != a[0]


def test_same_seed_same_tokens_across_modes_for_first_token(tiny_target, tiny_drafters):
    """The first token comes from the prefill round in every mode: same seed, same token."""
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=1)
    toks = {m: Decoder.from_pretrained(tiny_target, None if m == "ar" else tiny_drafters("vanilla", 4),
                                       mode=m).generate([[3, 4, 5]], p, use_tqdm=False)[0].token_ids
            for m in ("ar", "dflash", "dspark")}
    assert toks["ar"] == toks["dflash"] == toks["dspark"]


def test_max_tokens_and_stop_token_ids(dec):
    greedy = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    ref = dec.generate(PROMPTS, greedy, use_tqdm=False)
    for o in ref:
        assert len(o.token_ids) == 15 and o.finish_reason == "length"
    # stop at the 5th token of the first output: the commit is cut right after it
    stop_tok = ref[0].token_ids[4]
    first = ref[0].token_ids.index(stop_tok)
    out = dec.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True,
                                                   stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out.token_ids == ref[0].token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(dec):
    eos = dec.eos_token_ids
    assert eos, "the tiny target declares an eos token"
    ref = dec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)
    out = dec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for r, o in zip(ref, out):
        hits = [i for i, t in enumerate(r.token_ids) if t in eos]
        if hits:
            assert o.token_ids == r.token_ids[: hits[0] + 1] and o.finish_reason == "stop"
        else:
            assert o.token_ids == r.token_ids


def test_stop_strings_truncate_text():
    """A stop string in the middle of the greedy text ends the output right before it (the text
    stops short of it, the tokens are a prefix of the unstopped ones). The shipped pair, whose
    tokenizer writes real text, so the stop string always exists."""
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], mode="dspark")
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    ref = dec.generate([PROMPT_TEXT], SamplingParams(**greedy), use_tqdm=False)[0]
    text = ref.text
    assert len(text) >= 16, f"the greedy continuation is too short to cut: {text!r}"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = dec.generate([PROMPT_TEXT], SamplingParams(stop=[stop], **greedy), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == ref.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.5}, {"top_k": 2, "top_p": 0.9}])
def test_logprobs_are_target_logprobs(tiny_target, tiny_drafters, filters):
    """Reported log-probs equal log_softmax of the target's raw logits at each emitted token:
    before temperature and before top-k / top-p (filtered log-probs would be larger)."""
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), mode="dspark",
                                  dtype="float64")
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True, logprobs=True,
                       **filters)
    out = dec.generate([[9, 8, 7]], p, use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids)
    seq = [9, 8, 7] + out.token_ids
    logits = full_forward_logits(dec.target, seq)
    want = torch.log_softmax(logits[2 : 2 + len(out.token_ids)].double(), -1)
    want = want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-9)


def test_metrics_are_consistent(dec):
    outs = dec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert sum(m.acceptance_histogram) == m.num_rounds
        assert sum(i * c for i, c in enumerate(m.acceptance_histogram)) == m.num_accepted_draft_tokens
        assert m.num_accepted_draft_tokens <= m.num_draft_tokens
        # emitted tokens = first token + accepted + one per round (minus a possible truncation)
        assert len(o.token_ids) <= 1 + m.num_accepted_draft_tokens + m.num_rounds
        assert 1.0 <= m.mean_acceptance_length <= m.gamma + 1
        assert all(math.isnan(x) or 0 <= x <= 1 for x in m.acceptance_by_position)


def test_chat_renders_the_template_and_decodes_it(dec):
    """chat renders each conversation with the target's template (ChatML in the tiny fixture),
    opens the assistant's turn, and decodes the text as generate does."""
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]]
    want = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = dec.chat(convs, greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == want
    ref = dec.generate(want, greedy, use_tqdm=False)
    assert [(o.prompt_token_ids, o.token_ids) for o in outs] == \
        [(o.prompt_token_ids, o.token_ids) for o in ref]


def test_sync_policy_profiles_once_and_reuses_the_cache(tiny_target, tiny_drafters, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    drafter = tiny_drafters("vanilla", 4)
    first = Decoder.from_pretrained(tiny_target, drafter, mode="dspark", policy="sync")
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1 and first.policy.name == "sync"
    mtime = cached[0].stat().st_mtime_ns
    second = Decoder.from_pretrained(tiny_target, drafter, mode="dspark", policy="async")
    assert cached[0].stat().st_mtime_ns == mtime and second.policy.name == "async"
    ref = Decoder.from_pretrained(tiny_target, mode="ar").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    out = second.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_phase_timing_is_opt_in(dec):
    from dspark_rt.runner.round import Round
    from dspark_rt.testing import phases
    assert type(dec.engine.round) is Round
    times = phases.install(dec)
    try:
        dec.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert set(times) == {"draft", "schedule", "verify_forward", "accept", "context_update"}
        assert all(v >= 0 for v in times.values())
    finally:
        phases.uninstall(dec)
    assert type(dec.engine.round) is Round


def test_incremental_text_equals_full_decode():
    """Stop strings read IncrementalText: at every step its text is a prefix of decoding all ids,
    multi-byte characters split across tokens included, and it catches up on plain text."""
    import random
    from pathlib import Path

    from dspark_rt.checkpoint.tokenizer import IncrementalText, Tokenizer
    tok = Tokenizer.from_pretrained(Path(__file__).parents[2] / "dspark_rt" / "pretrained" / "target")
    rng = random.Random(0)
    samples = [tok.encode("naïve café — 世界 😀 ok"), tok.encode("def f(x):\n    return x\n")]
    samples += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]
    tail = tok.encode(" the end")
    for ids in samples:
        inc = IncrementalText(tok)
        for n, t in enumerate(ids + tail, 1):
            inc.push(t)
            assert tok.decode((ids + tail)[:n]).startswith(inc.text)
        assert inc.text == tok.decode(ids + tail)


def test_calibration_beside_the_drafter_is_in_force(tiny_target, tiny_drafters, tmp_path):
    """A dspark_calibration.json in the drafter folder is used unless another calibration is
    given (or "none"), and the Decoder says which temperatures are in force."""
    import shutil
    from dspark_rt.policies.sts import CALIBRATION_FILE, STSResult
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafters("gated", 4), drafter)
    assert Decoder.from_pretrained(tiny_target, drafter).calibration_source is None
    STSResult([0.5, 2.0, 3.0, 4.0], [], {}).save(drafter / CALIBRATION_FILE)
    dec = Decoder.from_pretrained(tiny_target, drafter)
    assert dec.calibration_source == str(drafter / CALIBRATION_FILE)
    assert dec.engine.calibration.temperatures == [0.5, 2.0, 3.0, 4.0]
    off = Decoder.from_pretrained(tiny_target, drafter, calibration="none")
    assert off.calibration_source is None and off.engine.calibration.temperatures == [1.0] * 4
    given = Decoder.from_pretrained(tiny_target, drafter, calibration=[2.0] * 4)
    assert given.calibration_source == "given" and given.engine.calibration.temperatures == [2.0] * 4
