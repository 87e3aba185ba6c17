"""LLM(model=..., speculative_config={...}): vLLM's entry point, returning a Decoder.

    llm = LLM(model="path/to/Qwen3-8B",
              speculative_config={"model": "path/to/dspark-drafter", "num_speculative_tokens": 7})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128))

speculative_config takes "model" (the drafter folder) and "num_speculative_tokens" (drafts
verified per round at most, <= the drafter's gamma); "method" may name the drafter's kind
(dspark or dflash: the Decoder's mode). Every other keyword is Decoder.from_pretrained's.
"""
from .decoder import Decoder

SPECULATIVE_KEYS = ("model", "num_speculative_tokens", "method")
METHODS = ("dspark", "dflash")


def LLM(model, *, speculative_config: dict | None = None, **kwargs) -> Decoder:  # noqa: N802 - vLLM's name
    """A Decoder of target `model` and the drafter of speculative_config (None: the target
    alone); kwargs: Decoder.from_pretrained's (vLLM's engine arguments among them)."""
    if speculative_config is None:
        return Decoder.from_pretrained(model, None, **kwargs)
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
    other = sorted(set(speculative_config) - set(SPECULATIVE_KEYS), key=str)
    if other:
        raise ValueError(f"speculative_config key {other[0]!r} is not served (served: "
                         f"{', '.join(SPECULATIVE_KEYS)}; docs/vllm.md)")
    if speculative_config.get("model") is None:
        raise ValueError("speculative_config needs 'model': the drafter folder")
    method = speculative_config.get("method")
    if method is not None:
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        if kwargs.setdefault("mode", method) != method:
            raise ValueError(f"speculative_config method {method!r} and mode {kwargs['mode']!r} differ")
    if "num_speculative_tokens" in speculative_config:
        if "num_speculative_tokens" in kwargs:
            raise TypeError("num_speculative_tokens given twice: in speculative_config and as a keyword")
        kwargs["num_speculative_tokens"] = speculative_config["num_speculative_tokens"]
    return Decoder.from_pretrained(model, speculative_config["model"], **kwargs)
