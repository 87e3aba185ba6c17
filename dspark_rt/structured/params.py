"""StructuredOutputsParams: what a request asks its output to match (vLLM's name and fields)."""
import json as _json
from dataclasses import dataclass

FORMS = ("json", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json, a JSON schema (a dict or its text; {"type": "object"} for any JSON
    object); regex, a regular expression the whole output must match; grammar, an EBNF / GBNF
    grammar; choice, a list of strings the output must be one of. Bad arguments, and grammars
    xgrammar cannot parse, are a ValueError naming the field (and xgrammar's message)."""
    json: object = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple | list | None = None

    def __post_init__(self):
        given = [f for f in FORMS if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(FORMS)} must be set, "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got "
                             f"{type(self.json).__name__}")
        for f in ("regex", "grammar"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), str):
                raise ValueError(f"structured_outputs.{f} must be a str")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty str")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        from .grammar import parse  # xgrammar's parser: its message, before any work
        parse(self)

    @property
    def form(self) -> str:
        return next(f for f in FORMS if getattr(self, f) is not None)

    def key(self) -> tuple:
        """A hashable identity of the grammar (the compile cache's key)."""
        v = getattr(self, self.form)
        if isinstance(v, dict):
            v = _json.dumps(v, sort_keys=True)
        return self.form, v
