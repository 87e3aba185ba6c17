"""What a vLLM user types and reads: generate(prompts, sampling_params=...) with str, token-id
and dict prompts; RequestOutput.outputs[0] with text, token_ids, finish_reason, stop_reason,
cumulative_logprob; finished; the speculative metrics under the HTTP server's (vLLM's) names,
the release-0.1 names as read-only aliases; chat with template variables."""
import json
import shutil

import pytest

from dspark_rt import CompletionOutput, Decoder, SamplingParams, SpecMetrics
from tests.support.shipped_pair import DRAFTERS, PROMPTS, TARGET

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dec(tiny_target, tiny_drafters):
    return Decoder.from_pretrained(tiny_target, tiny_drafters("gated", 4), mode="dspark")


@pytest.fixture(scope="module")
def shipped():
    """The shipped trained pair: its drafts are accepted (the tiny random pair's are not)."""
    return Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"])


def test_sampling_params_keyword_and_the_old_name(dec):
    a = dec.generate([[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0]
    b = dec.generate([[5, 6, 7]], params=GREEDY, use_tqdm=False)[0]
    c = dec.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 12
    with pytest.raises(TypeError, match="sampling_params= or params="):
        dec.generate([[5, 6, 7]], sampling_params=GREEDY, params=GREEDY, use_tqdm=False)


def test_dict_prompts_are_vllms(dec):
    text, ids = "hello world", [20, 21, 22]
    plain = dec.generate([text, ids], GREEDY, use_tqdm=False)
    dicts = dec.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert [o.prompt for o in dicts] == [text, None]
    assert dicts[1].prompt_token_ids == ids
    one = dec.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in one] == [plain[1].token_ids]
    streamed = [t for s in dec.stream({"prompt": text}, GREEDY) for t in s.new_token_ids]
    assert streamed == plain[0].token_ids
    for bad, match in [({"prompt": text, "multi_modal_data": {}}, "'multi_modal_data' is not served"),
                       ({"prompt": text, "prompt_token_ids": ids}, "exactly one"),
                       ({}, "exactly one"), ({"prompt": ids}, "'prompt' must be a str"),
                       ({"prompt_token_ids": "x"}, "'prompt_token_ids' must be a list")]:
        with pytest.raises(ValueError, match=match) as err:
            dec.generate([ids, bad], GREEDY, use_tqdm=False)
        assert "request 1" in str(err.value)


def test_request_output_has_vllms_fields_and_the_shortcuts(dec):
    out = dec.generate(["hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                 logprobs=0), use_tqdm=False)[0]
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and len(out.outputs) == 1 and c.index == 0
    assert out.finished and c.finished() and out.prompt == "hello"
    assert (out.text, out.token_ids, out.finish_reason) == (c.text, c.token_ids, c.finish_reason)
    assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.stop_reason is None
    assert c.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=0) and c.cumulative_logprob < 0
    assert out.cumulative_logprob == c.cumulative_logprob
    none = dec.generate(["hello"], GREEDY, use_tqdm=False)[0]
    assert none.cumulative_logprob is None and none.outputs[0].logprobs is None and none.logprobs is None


def test_stop_reason_names_what_ended_the_output(dec):
    ref = dec.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    tok = ref[3]
    out = dec.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                   stop_token_ids=[tok]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok == out.token_ids[-1]
    # the end-of-sequence token stops without a stop_reason (vLLM's meaning)
    eos = dec.eos_token_ids[0]
    from dspark_rt.engine.processing import Processor
    p = Processor(None, vocab_size=96, max_model_len=512, eos_token_ids=[eos], gamma=4)
    req = p.request(0, [1, 2], SamplingParams(max_tokens=8), 0, 0, 1)
    p.commit(req, [7, eos, 9], None)
    assert (req.finish_reason, req.stop_reason, req.output_ids) == ("stop", None, [7, eos])
    req = p.request(0, [1, 2], SamplingParams(max_tokens=8, stop_token_ids=[eos]), 1, 0, 2)
    p.commit(req, [eos], None)
    assert (req.finish_reason, req.stop_reason) == ("stop", eos)


def test_stop_reason_is_the_stop_string(shipped):
    dec = shipped
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    text = dec.generate(["def parse_args(argv):\n"], SamplingParams(**greedy), use_tqdm=False)[0].text
    stops = [text[len(text) // 2 : len(text) // 2 + 3], "\x00never"]
    out = dec.generate(["def parse_args(argv):\n"], SamplingParams(stop=stops, **greedy),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stops[0]


def test_metrics_use_vllms_names_and_keep_the_old_ones(shipped):
    sp = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)]
    spec, plain = (o.metrics for o in shipped.generate(PROMPTS[:2], sp, use_tqdm=False))
    assert spec.num_spec_steps == spec.verified_by_position[0] > 0
    assert spec.num_accepted_draft_tokens == sum(spec.num_accepted_tokens_per_pos) > 0
    assert spec.mean_acceptance_length == 1 + spec.num_accepted_draft_tokens / spec.num_spec_steps
    # a request that never drafted: rounds, but no spec steps (the server counts alike)
    assert plain.num_spec_steps == plain.num_draft_tokens == 0 < plain.num_rounds
    assert plain.mean_acceptance_length == 1.0
    assert spec.num_accepted_tokens == spec.num_accepted_draft_tokens  # release 0.1's names
    assert spec.accepted_by_position == spec.num_accepted_tokens_per_pos
    with pytest.raises(AttributeError):
        spec.num_accepted_tokens = 0
    d = spec.as_dict()
    assert {"num_spec_steps", "num_rounds", "num_draft_tokens", "num_accepted_draft_tokens",
            "num_accepted_tokens_per_pos", "mean_acceptance_length"} <= set(d)
    assert "num_accepted_tokens" not in d and d["num_spec_steps"] == spec.num_spec_steps
    merged = SpecMetrics.merged([spec, plain])
    assert merged.num_spec_steps == spec.num_spec_steps
    assert merged.num_rounds == spec.num_rounds + plain.num_rounds


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")


def test_chat_passes_template_variables(tiny_target, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    dec = Decoder.from_pretrained(target, mode="ar")
    conv = [{"role": "user", "content": "hi"}]
    head = "<|im_start|>user\nhi<|im_end|>\n"
    on = dec.chat(conv, GREEDY, use_tqdm=False)[0]
    off = dec.chat(conv, sampling_params=GREEDY, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    bare = dec.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert on.prompt == head + "<|im_start|>assistant\n"
    assert off.prompt == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert bare.prompt == head
    assert off.token_ids == dec.generate([off.prompt], GREEDY, use_tqdm=False)[0].token_ids
    for bad, match in [({"add_generation_prompt": False}, "'add_generation_prompt' is set by"),
                       (["enable_thinking"], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            dec.chat(conv, GREEDY, chat_template_kwargs=bad)
