"""Strict requests, one rule, through the real `openai` client against a live server: an unknown
field, or a known one at a value the server does not serve, is a 400 naming it on both
endpoints, streamed or not; what clients send by default is accepted; the cheap fields are
served (include_stop_str_in_output, add_generation_prompt, chat_template_kwargs,
max_completion_tokens over max_tokens, stream_options.continuous_usage_stats)."""

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET, _Server  # noqa: E402

# a Qwen3-style switch: with enable_thinking false the template closes an empty think block
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        (target / f).symlink_to(f"{TARGET}/{f}")
    config = json.loads((Path(TARGET) / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(config | {
        "chat_template": THINKING_TEMPLATE}))
    state = build_state(str(target), DRAFTER, served_model_name=MODEL, max_num_seqs=8,
                        dtype="float32")
    srv = _Server(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "Sort a list."}]


def _create(client, kind, stream, **kw):
    """One request of kind "completion" / "chat", read to the end when streamed."""
    if kind == "chat":
        r = client.chat.completions.create(model=MODEL, messages=MSGS, stream=stream, **kw)
    else:
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=stream, **kw)
    return list(r) if stream else r


def _refused(client, kind, stream, extra, field, words=()):
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, kind, stream, max_tokens=4, extra_body=extra)
    err = e.value.body
    assert err["param"] == field and field in err["message"], err
    for w in words:
        assert w in err["message"], err


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_refused_by_name(client, kind, stream):
    _refused(client, kind, stream, {"frobnicate": 1}, "frobnicate", ["unknown field"])
    _refused(client, kind, stream, {"max_token": 8}, "max_token", ["unknown field"])  # a typo
    if stream:
        _refused(client, kind, stream, {"stream_options": {"include_usage": True, "every": 1}},
                 "stream_options.every", ["unknown field"])


LATER = [  # field, a value that would change the output (structured output is served:
    # tests/server/test_server_structured.py)
    ("use_beam_search", True), ("presence_penalty", 0.5),
    ("repetition_penalty", 1.2), ("logit_bias", {"5": 10}), ("n", 2),
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_unserved_fields_are_refused_by_name(client, kind, stream):
    for field, value in LATER:
        _refused(client, kind, stream, {field: value}, field)
    for field in ("presence_penalty", "use_beam_search"):
        _refused(client, kind, stream, {field: dict(LATER)[field]}, field, ["not served yet"])
    if kind == "chat":  # completions serve echo (tests/server/test_server_echo.py)
        _refused(client, kind, stream, {"echo": True}, "echo", ["not served yet"])
        _refused(client, kind, stream, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                 "tools", ["not served yet"])


def test_message_fields_are_checked(client):
    msgs = [{"role": "user", "content": "hi", "mood": "sunny"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert e.value.body["param"] == "messages[0].mood"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_what_clients_send_by_default_is_accepted(client, kind):
    neutral = {"user": "u-1", "service_tier": "auto", "metadata": {"k": "v"}, "store": False,
               "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
               "min_tokens": 0, "min_p": 0, "echo": False, "use_beam_search": False,
               "logit_bias": {}, "response_format": {"type": "text"}, "stop": None}
    if kind == "chat":
        neutral |= {"tools": [], "tool_choice": "none", "parallel_tool_calls": True}
    plain = _create(client, kind, False, max_tokens=6, temperature=0)
    got = _create(client, kind, False, max_tokens=6, temperature=0, extra_body=neutral)
    assert got.usage == plain.usage
    # guidellm streams with these two stream options
    chunks = _create(client, kind, True, max_tokens=6, temperature=0,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert chunks[-1].usage == plain.usage
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts)


def test_max_completion_tokens_wins_over_max_tokens(client):
    for kind in ("completion", "chat"):
        r = _create(client, kind, False, max_tokens=9, temperature=0,
                    extra_body={"max_completion_tokens": 3, "ignore_eos": True})
        assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, stream):
    kw = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], **kw).choices[0].text
    stop = full[10:13]
    assert stop.strip(), full
    cut = full[: full.index(stop)]

    def text(**more):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], stop=[stop], stream=stream,
                                      **kw | more)
        return "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text() == cut
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    assert text() == cut + stop


def test_chat_template_kwargs_and_add_generation_prompt(server, client):
    tok = server.state.tokenizer

    def prompt_tokens(**extra):
        return client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens
    plain = prompt_tokens()
    think_off = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    want = tok.apply_chat_template(MSGS, enable_thinking=False)
    assert think_off == len(tok.encode(want)) and think_off > plain
    assert prompt_tokens(add_generation_prompt=False) == \
        len(tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=False))) < plain
    for bad in ({"messages": []}, {"add_generation_prompt": False}, ["enable_thinking"]):
        with pytest.raises(openai.BadRequestError) as e:
            prompt_tokens(chat_template_kwargs=bad)
        assert e.value.body["param"] == "chat_template_kwargs"
