"""The ways an OpenAI / vLLM request asks for structured output, read into one
StructuredOutputsParams: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. Plain dicts in, so the server (and anything else) calls it on a request body.
"""
from .params import FORMS, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "xgrammar")


class FieldError(ValueError):
    """A bad structured-output field; `field` names it (a server's 400)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def _params(field: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:  # the form's own message (xgrammar's, for a bad grammar)
        raise FieldError(field, str(e).removeprefix("structured_outputs").lstrip(".: ")) from None


def _response_format(rf) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format", "must be {\"type\": \"text\" | \"json_object\" | "
                         f"\"json_schema\", ...}}, got {rf!r:.80}")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return _params("response_format", json={"type": "object"})
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, str)):
        raise FieldError("response_format.json_schema.schema", "a JSON schema (object) is required")
    if js.get("strict") not in (None, True, False):
        raise FieldError("response_format.json_schema.strict", "must be a bool")
    return _params("response_format.json_schema.schema", json=js["schema"])


def from_request(body: dict) -> StructuredOutputsParams | None:
    """The StructuredOutputsParams a request body asks for (None: plain text), or FieldError
    naming the field: an unknown form, a bad grammar (xgrammar's message), or two ways of asking
    at once. Null values are absent fields."""
    asked = []
    if body.get("response_format") is not None:
        p = _response_format(body["response_format"])
        if p is not None:
            asked.append(("response_format", p))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise FieldError("structured_outputs", f"must be an object with one of {', '.join(FORMS)}")
        kw = {k: v for k, v in so.items() if v is not None}
        if kw.pop("json_object", None):
            kw.setdefault("json", {"type": "object"})
        bad = sorted(set(kw) - set(FORMS))
        if bad:
            raise FieldError(f"structured_outputs.{bad[0]}", f"not served (served: {', '.join(FORMS)})")
        asked.append(("structured_outputs", _params("structured_outputs", **kw)))
    for name, form in GUIDED.items():
        if body.get(name) is not None:
            asked.append((name, _params(name, **{form: body[name]})))
    if body.get("guided_decoding_backend") not in BACKENDS:
        raise FieldError("guided_decoding_backend", "only xgrammar serves structured output here")
    if body.get("guided_whitespace_pattern") is not None:
        raise FieldError("guided_whitespace_pattern", "not served (JSON is compact)")
    if len(asked) > 1:
        raise FieldError(asked[1][0], f"asks for structured output besides {asked[0][0]}: "
                         "use one of them")
    return asked[0][1] if asked else None
