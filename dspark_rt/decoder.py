"""The public entry point: Decoder.from_pretrained(target, drafter).generate(prompts, params).

A facade over one Engine (engine/engine.py), which owns the requests and the loop; the Decoder
loads the models, resolves the mode and the policy (profiling the machine once for sync / async)
and sizes the Engine's KV pool to the batches it is given.
"""
import itertools
import math
import numbers
import threading
from pathlib import Path

import torch

from .checkpoint.config import TargetConfig
from .checkpoint.tensors import resolve_dtype
from .engine import EngineConfig
from .engine.engine import Engine
from .models.drafter import Drafter
from .models.load import load_drafter
from .models.qwen3 import Qwen3Model, pick_dtype
from .outputs import RequestOutput
from .policies import OnlineCalibration
from .policies.calibration import as_calibration
from .policies.sts import CALIBRATION_FILE
from .runner.resolve import resolve_policy
from .runner.runner import MODES, Runner
from .sampling_params import SamplingParams
from .checkpoint.tokenizer import Tokenizer


def _device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA device is available here "
                         "(torch.cuda.is_available() is False); use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    return device


def _seed(seed) -> int:
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed)


class Decoder:
    """DSpark speculative decoding of a target model with a drafter.

    mode: "ar" (target alone), "dflash" (backbone drafts, all verified) or "dspark" (sequential
    head + confidence-scheduled verification; the default when the drafter has a head).
    policy: "fixed" | "threshold" | "sync" | "async" | "auto" | a VerifyPolicy (used in "dspark"
    mode); "sync" and "async" read sps= (a measured throughput profile or its JSON path); without
    it the runner is profiled once and cached by device identity; "auto" (also decides per round
    whether to draft at all) reads sps=(speculative, plain-round, no-drafts, context-update
    profiles) likewise, any of them None to measure it. calibration: STS temperatures
    (a Calibration, a list, or the path of a JSON written by dspark_rt.policies.sts or SGLang);
    from_pretrained uses the drafter folder's dspark_calibration.json when none is given.
    calibration_source says which temperatures are in force (a path, "given" or None; with
    " + online" appended under online_calibration). online_calibration: refit the calibration
    from the rounds served (policies.OnlineCalibration, starting from the one above; dspark
    mode with a confidence head).
    """

    def __init__(self, target: Qwen3Model, drafter: Drafter | None, tokenizer: Tokenizer | None, *,
                 mode=None, policy="fixed", threshold=0.5, sps=None, calibration=None,
                 page_size=16, seed=0, device="cpu", tensor_parallel=None,
                 online_calibration=False, policy_options=None):
        self.device = _device(device)
        seed = _seed(seed)
        if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or \
                not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        self.tensor_parallel = tensor_parallel  # parallel.TensorParallel: the worker ranks
        if mode is None:
            mode = "ar" if drafter is None else (
                "dspark" if drafter.head != "none" or drafter.conf_w is not None else "dflash")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.target, self.drafter, self.tokenizer, self.mode = target, drafter, tokenizer, mode
        if tokenizer is not None and tokenizer.vocab_size > target.config.vocab_size:
            raise ValueError(f"{getattr(tokenizer, 'path', '')}/tokenizer.json has "
                             f"{tokenizer.vocab_size} tokens, more than the target's vocab_size "
                             f"{target.config.vocab_size}: its ids would index past the embedding")
        self.runner = (Runner(target, drafter, mode, page_size, self.device) if tensor_parallel is None
                       else tensor_parallel.runner(target, drafter, mode, page_size, self.device))
        options = dict(policy_options or {})
        if policy == "threshold":
            options.setdefault("threshold", threshold)
        self.policy = resolve_policy(policy, self.runner, sps=sps, options=options,
                                     measure=tensor_parallel is None)
        self.calibration = as_calibration(calibration, self.runner.gamma)
        self.calibration_source = (str(calibration) if isinstance(calibration, (str, Path)) else
                                   None if calibration is None else "given")
        if not isinstance(online_calibration, bool):
            raise ValueError(f"online_calibration must be a bool, got {online_calibration!r}")
        if online_calibration and mode == "dspark" and self.runner.has_confidence:
            self.calibration = OnlineCalibration(self.calibration, self.runner.gamma)
            self.calibration_source = f"{self.calibration_source or 'uncalibrated'} + online"
        self.seed = seed
        self._ids = itertools.count()  # request ids and random streams, across this Decoder's Engines
        self._lock = threading.Lock()  # sizing the Engine and queueing a batch happen together
        self.engine = self.new_engine(EngineConfig(num_pages=1, max_num_seqs=1))  # sized by reserve

    @classmethod
    def from_pretrained(cls, target, drafter=None, *, device="cpu", dtype=None,
                        tensor_parallel_size: int = 1, **kwargs):
        """target: a Hugging Face Qwen3 / Llama folder; drafter: a DeepSpec DSpark/DFlash or
        z-lab DFlash folder (or None for plain decoding). Without calibration=, the STS
        temperatures `dspark-rt calibrate` wrote beside the drafter are used when present, else
        those the drafter's config ships (sts_temperatures); calibration="none": uncalibrated.
        tensor_parallel_size=N > 1 shards both models over N ranks: this process is rank 0, N - 1
        worker processes are started (NCCL on CUDA, rank r on cuda:r; gloo on the CPU); see
        shutdown()."""
        device = _device(device)
        cal = kwargs.get("calibration")
        if isinstance(cal, str) and cal == "none":
            kwargs["calibration"] = None
        elif cal is None and drafter is not None and (Path(drafter) / CALIBRATION_FILE).is_file():
            kwargs["calibration"] = Path(drafter) / CALIBRATION_FILE
        # "auto": the checkpoint's half dtype on a GPU, float32 on the CPU (models.qwen3.pick_dtype)
        dt = None if dtype is None or (isinstance(dtype, str) and dtype == "auto") else resolve_dtype(dtype)
        tok = Tokenizer.from_pretrained(target) if (Path(target) / "tokenizer.json").exists() else None
        if isinstance(tensor_parallel_size, bool) or \
                not isinstance(tensor_parallel_size, numbers.Integral) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        if tensor_parallel_size != 1:
            from .parallel import TensorParallel
            dt = pick_dtype(TargetConfig.from_json(target), dt, device)
            tp = TensorParallel(int(tensor_parallel_size), target, drafter, dt, device)
            try:
                return cls(tp.target, tp.drafter, tok, device=device, tensor_parallel=tp, **kwargs)
            except BaseException:
                tp.shutdown()
                raise
        tgt = Qwen3Model.from_pretrained(target, dtype=dt, device=device)
        drf = load_drafter(drafter, tgt, dtype=tgt.dtype, device=device) if drafter else None
        shipped = cal is None and kwargs.get("calibration") is None and drf is not None and \
            getattr(drf, "sts_temperatures", None)
        if shipped:  # STS temperatures shipped inside the drafter's config
            kwargs["calibration"] = list(drf.sts_temperatures)
        dec = cls(tgt, drf, tok, device=device, **kwargs)
        if shipped:
            dec.calibration_source = dec.calibration_source.replace(
                "given", f"{Path(drafter) / 'config.json'} (sts_temperatures)")
        return dec

    def shutdown(self):
        """Stops the tensor-parallel workers (also at exit, and on leaving a `with` block); a
        single-process Decoder has nothing to stop. The Decoder cannot generate afterwards."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def new_engine(self, config: EngineConfig | None = None, **kwargs) -> Engine:
        """A new Engine over this Decoder's models (it takes over the KV caches: the previous
        Engine stops); generate and stream run on it from then on. What was set on the previous
        Engine (its Round, calibration and round log) carries over."""
        old = getattr(self, "engine", None)
        self.engine = Engine(self.runner, config, policy=self.policy, calibration=self.calibration,
                             tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                             seed=self.seed, request_ids=self._ids, **kwargs)
        if old is not None:
            e = self.engine
            e.round, e.calibration, e.round_log = old.round, old.calibration, old.round_log
        return self.engine

    @property
    def eos_token_ids(self) -> list[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return list(self.tokenizer.eos_token_ids)
        eos = self.target.config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @property
    def max_model_len(self) -> int:
        return self.runner.max_len

    @property
    def round_log(self) -> list[dict] | None:
        """Every round of the Engine when set to a list (calibration and diagnostics read it)."""
        return self.engine.round_log

    @round_log.setter
    def round_log(self, value):
        self.engine.round_log = value

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts, params=None, *, use_tqdm=True) -> list[RequestOutput]:
        """prompts: a str, a list of str, a list of token ids or a list of token-id lists.
        params: one SamplingParams for all, or one per prompt. All requests are checked before
        any work starts, so a bad request costs the others nothing. Safe to call from several
        threads: their requests share the Engine's rounds."""
        prompts = _prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        reqs = [self.engine.make_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        if not reqs:
            return []
        with self._lock:
            eng = self.engine
            eng.reserve(reqs)
            eng.add_all(reqs)
        return eng.drive(reqs, use_tqdm=use_tqdm, desc=f"dspark_rt {self.mode}")

    def chat(self, messages, params=None, **kwargs) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer in the target folder")
        convs = _conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params, **kwargs)

    def stream(self, prompt, params=None, *, num_pages: int = 512):
        """Yields the request's new tokens round by round (engine.StepOutput: new_token_ids,
        finished, and the full RequestOutput on the last one). Other open streams of this
        Decoder advance in the same rounds. The arguments are checked here, at the call; the
        request is queued at the first next()."""
        req = self.engine.make_request(prompt, params if params is not None else SamplingParams())
        return self._stream(req, num_pages)

    def _stream(self, req, num_pages):
        with self._lock:
            eng = self.engine
            eng.reserve([req], num_pages)
            eng.add(req)
        yield from eng.stream_request(req)

def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p)


def _prompt_list(prompts) -> list:
    """One prompt (a str or token ids) or a list of them, as a list; anything else is a
    TypeError naming the argument (the prompts themselves are checked per request)."""
    if isinstance(prompts, str) or _is_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those, got "
                        f"{type(prompts).__name__}")
    return list(prompts)


def _conversations(messages) -> list:
    """One conversation (a list of message dicts) or a list of conversations, each checked."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        convs = [messages]
    elif isinstance(messages, (list, tuple)) and messages:
        convs = list(messages)
    else:
        raise ValueError("chat: messages must be a non-empty list of {'role', 'content'} dicts, "
                         f"or a list of such lists; got {messages!r:.80}")
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ValueError(f"chat: messages[{i}] must be a non-empty list of message dicts, "
                             f"got {conv!r:.80}")
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), (str, type(None), list)):
                raise ValueError(f"chat: messages: conversation {i}, message {j} must be a dict "
                                 f"with a str 'role' and a str 'content', got {m!r:.80}")
    return convs
