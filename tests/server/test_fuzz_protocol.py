"""Bounded fuzz of the HTTP request models (server/protocol.py): any JSON value in any field, or
a body of junk, gives the APIError 400 naming the field (the server's 400 path) or a checked
request, never another exception. Sized to run in seconds (max_examples, derandomized)."""
import asyncio
import json
from importlib.resources import files

import pytest
from hypothesis import given, strategies as st

from dspark_rt import SamplingParams
from dspark_rt.checkpoint.tokenizer import Tokenizer
from dspark_rt.server.protocol import APIError, GenRequest, parse_chat, parse_completion
from tests.support.fuzz_support import FUZZ, JUNK, NASTY, VALUE

TARGET = str(files("dspark_rt") / "pretrained" / "target")
SAMPLING = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
            "seed", "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "logit_bias", "stop", "stop_token_ids", "ignore_eos", "speculative", "stream",
            "stream_options"]
COMPLETION = SAMPLING + ["prompt", "echo", "suffix", "logprobs"]
CHAT = SAMPLING + ["messages", "tools", "response_format", "logprobs", "top_logprobs"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TARGET)


def _check(parse, body, field=None):
    """parse(body) either gives a checked GenRequest or an APIError 400 naming a field."""
    try:
        g = parse(body)
    except APIError as e:
        assert e.status == 400 and e.message, e
        if field is not None:  # the fuzzed field, or the option inside it that is bad
            assert e.param in (field, "include_usage", "request"), (field, e.param, e.message)
        json.dumps(e.body())  # the 400 body is sent as JSON
        return
    assert isinstance(g, GenRequest) and isinstance(g.params, SamplingParams)
    g.params.check()


@FUZZ
@given(field=st.sampled_from(COMPLETION), value=VALUE)
def test_completion_field(field, value):
    _check(lambda b: parse_completion(b, default_model="tiny"), {"prompt": "hi", field: value},
           field)


@FUZZ
@given(field=st.sampled_from(CHAT), value=VALUE)
def test_chat_field(tok, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    _check(lambda b: parse_chat(b, default_model="tiny", tokenizer=tok, max_model_len=512),
           body, field)


@pytest.mark.parametrize("value", NASTY, ids=repr)
def test_every_field_meets_the_nasty_values(tok, value):
    for field in COMPLETION:
        _check(lambda b: parse_completion(b, default_model="tiny"), {"prompt": "hi", field: value},
               field)
    for field in CHAT:
        body = {"messages": [{"role": "user", "content": "hi"}], field: value}
        _check(lambda b: parse_chat(b, default_model="tiny", tokenizer=tok, max_model_len=512),
               body, field)


@FUZZ
@given(body=JUNK | st.dictionaries(st.sampled_from(sorted(set(COMPLETION + CHAT))), JUNK,
                                   max_size=6))
def test_junk_bodies(tok, body):
    _check(lambda b: parse_completion(b, default_model="tiny"), body)
    _check(lambda b: parse_chat(b, default_model="tiny", tokenizer=tok, max_model_len=512), body)


class _Body:
    """The part of a starlette Request that app._json reads."""

    def __init__(self, raw: bytes):
        self.raw, self.headers = raw, {"content-length": str(len(raw))}

    async def stream(self):
        yield self.raw


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"prompt": ' * 50_000, b"\xff\xfe{}",
                                 b'{"prompt": "hi", "temperature": NaN}'])
def test_body_reader_gives_400_or_json(raw):
    """Nesting deeper than the interpreter's recursion limit, bytes that are not UTF-8: the 400
    path (not a 500 from a RecursionError)."""
    pytest.importorskip("fastapi")
    from dspark_rt.server.app import _json
    try:
        body = asyncio.run(_json(_Body(raw), 1 << 20))
    except APIError as e:
        assert e.status == 400 and "JSON" in e.message
        return
    _check(lambda b: parse_completion(b, default_model="tiny"), body)
