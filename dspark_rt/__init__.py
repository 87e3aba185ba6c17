"""dspark_rt: DSpark speculative decoding runtime.

    from dspark_rt import Decoder, SamplingParams
    dec = Decoder.from_pretrained("path/to/qwen3", "path/to/dspark-drafter")
    out = dec.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))

or vLLM's shape: LLM(model="path/to/qwen3", speculative_config={"model": "path/to/drafter"}).
"""
__version__ = "0.1.0"

from .engine.config import EngineConfig
from .outputs import CompletionOutput, Logprob, RequestOutput, SpecMetrics
from .policies import Calibration, FixedPolicy, ThresholdPolicy, VerifyPolicy
from .sampling_params import SamplingParams


def __getattr__(name):
    # The Decoder pulls in the models; import it lazily so `import dspark_rt` stays light.
    if name == "Decoder":
        from .decoder import Decoder
        return Decoder
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "Engine":
        from .engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'dspark_rt' has no attribute {name!r}")


__all__ = ["Decoder", "LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "SpecMetrics", "Calibration", "VerifyPolicy",
           "FixedPolicy", "ThresholdPolicy", "__version__"]
