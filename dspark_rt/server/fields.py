"""The request fields each endpoint reads: one table per endpoint, one rule for all of them.

Every key of a request body (and of `stream_options`, and of each chat message) is looked up:
  served    read and honoured by protocol.py (it checks the value);
  inert     accepted with any value: clients send them and they change nothing generated
            (`user`, `metadata`, `service_tier`, ...);
  neutral   accepted only at a value that changes nothing (`n: 1`, `presence_penalty: 0`,
            `echo: false`, `tools: []`); any other value is a 400 that names the field and says
            why it is not served (yet);
anything else is a 400 naming the unknown field. A null value is an absent field. The tables
are the fields table of docs/vllm.md.
"""
from dataclasses import dataclass

from .errors import APIError


@dataclass(frozen=True)
class Neutral:
    """A field accepted only at one of `values`; `why`: what serving any other value needs."""
    values: tuple
    why: str


_LATER = "not served yet"  # needs sampler or lossless work (DESIGN: a logits processor must
# change the target's rows and the draft's q identically)

_SAMPLER = "not served yet: it changes the target distribution, so the draft's q must change alike"

# -- both endpoints --------------------------------------------------------------------------

SERVED_COMMON = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "speculative",
    "skip_special_tokens", "include_stop_str_in_output", "logprobs", "prompt_logprobs",
    # logits processors of the target's rows (lossless under speculation: docs/sampling.md)
    "min_p", "min_tokens", "allowed_token_ids", "bad_words",
    # structured output (docs/structured.md), read by dspark_rt.structured.request.from_request
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
}

# sent by clients and SDKs on every request; nothing generated depends on them
INERT_COMMON = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
                "safety_identifier"}

NEUTRAL_COMMON = {
    "n": Neutral((1,), "only n = 1 is served (one choice per request)"),
    "best_of": Neutral((1,), "only best_of = 1 is served"),
    "presence_penalty": Neutral((0,), f"penalties are {_SAMPLER} (0 only)"),
    "frequency_penalty": Neutral((0,), f"penalties are {_SAMPLER} (0 only)"),
    "repetition_penalty": Neutral((1,), f"penalties are {_SAMPLER} (1 only)"),
    "logit_bias": Neutral(({},), f"logit_bias is {_SAMPLER}"),
    "use_beam_search": Neutral((False,), f"beam search is {_LATER}"),
    "length_penalty": Neutral((1,), f"length_penalty (beam search) is {_LATER}"),
    "priority": Neutral((0,), "priority scheduling is not served (0 only)"),
    "truncate_prompt_tokens": Neutral((), "prompt truncation is not served"),
    "spaces_between_special_tokens": Neutral((True,), "the text is decoded as one piece "
                                             "(true only)"),
}

# -- per endpoint ----------------------------------------------------------------------------

COMPLETION = dict(
    served=SERVED_COMMON | {"prompt", "echo"},
    inert=INERT_COMMON,
    neutral=NEUTRAL_COMMON | {
        "suffix": Neutral(("",), "suffix (fill-in-the-middle) is not served"),
    },
)

CHAT = dict(
    served=SERVED_COMMON | {"messages", "top_logprobs", "chat_template_kwargs",
                            "add_generation_prompt"},
    inert=INERT_COMMON | {"parallel_tool_calls"},  # without tools it changes nothing
    neutral=NEUTRAL_COMMON | {
        "tools": Neutral(((),), f"tool calling is {_LATER}"),
        "tool_choice": Neutral(("none", "auto"), f"tool calling is {_LATER}"),
        "functions": Neutral(((),), f"tool calling is {_LATER}"),
        "function_call": Neutral(("none", "auto"), f"tool calling is {_LATER}"),
        "echo": Neutral((False,), f"echo is {_LATER}"),
        "continue_final_message": Neutral((False,), f"continue_final_message is {_LATER}"),
        "chat_template": Neutral((), "a request's own chat template is not served (the "
                                 "target's is used)"),
        "documents": Neutral((), "documents are not served"),
    },
)

STREAM_OPTIONS = dict(served={"include_usage", "continuous_usage_stats"}, inert=set(), neutral={})

MESSAGE = dict(
    served={"role", "content", "name"},
    inert=set(),
    neutral={"tool_calls": Neutral(((),), f"tool calling is {_LATER}"),
             "tool_call_id": Neutral((), f"tool calling is {_LATER}")},
)


def _is_neutral(v, values) -> bool:
    for n in values:
        if isinstance(n, tuple):  # an empty list
            if isinstance(v, list) and tuple(v) == n:
                return True
        elif isinstance(v, bool) or isinstance(n, bool):  # true is not 1
            if v is n:
                return True
        elif v == n:  # 0 == 0.0
            return True
    return False


def check_fields(body: dict, table: dict, where: str = ""):
    """Raises APIError 400 naming the first field of body that the table does not know, or
    that holds a value the server cannot honour. where: a prefix for the field's name
    (`stream_options.`, `messages[2].`)."""
    for name, v in body.items():
        if name in table["served"] or name in table["inert"]:
            continue
        field = f"{where}{name}"
        rule = table["neutral"].get(name)
        if rule is None:
            raise APIError(400, f"{field}: unknown field; this server does not read it (the "
                           "fields it serves are listed in docs/vllm.md)", field)
        if v is not None and not _is_neutral(v, rule.values):
            raise APIError(400, f"{field}: {rule.why} (got {_short(v)})", field)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."

# -- /tokenize and /detokenize (vLLM's shapes) -----------------------------------------------

TOKENIZE = dict(served={"model", "prompt", "add_special_tokens", "return_token_strs"},
                inert=set(), neutral={})
TOKENIZE_CHAT = dict(served={"model", "messages", "add_generation_prompt", "chat_template_kwargs",
                             "add_special_tokens", "return_token_strs"},
                     inert=set(), neutral={"tools": CHAT["neutral"]["tools"],
                                           "continue_final_message":
                                               CHAT["neutral"]["continue_final_message"]})
DETOKENIZE = dict(served={"model", "tokens"}, inert=set(), neutral={})
