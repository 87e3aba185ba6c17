"""The public entry point: Decoder.from_pretrained(target, drafter).generate(prompts, params).

A facade over one Engine (engine/engine.py), which owns the requests and the loop; the Decoder
loads the models, resolves the mode and the policy (profiling the machine once for sync / async)
and sizes the Engine's KV pool to the batches it is given.
"""
import inspect
import itertools
import numbers
import threading
from pathlib import Path

from . import engine_args
from .checkpoint.config import TargetConfig
from .checkpoint.tensors import resolve_dtype
from .engine import EngineConfig
from .engine.engine import Engine
from .engine_args import EngineArgs
from .inputs import conversations, prompt_list, template_kwargs, unwrap
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
    vLLM's engine arguments by their names (max_model_len, gpu_memory_utilization, max_num_seqs,
    max_num_batched_tokens, enforce_eager, num_speculative_tokens): engine_args.EngineArgs;
    `limits` holds what they cap (engine.config.EngineLimits).
    """

    def __init__(self, target: Qwen3Model, drafter: Drafter | None, tokenizer: Tokenizer | None, *,
                 mode=None, policy="fixed", threshold=0.5, sps=None, calibration=None,
                 page_size=16, seed=0, device="cpu", tensor_parallel=None,
                 online_calibration=False, policy_options=None, max_model_len=None,
                 gpu_memory_utilization=None, max_num_seqs=None, max_num_batched_tokens=None,
                 enforce_eager=False, num_speculative_tokens=None):
        self.device = engine_args.device(device)
        seed = engine_args.seed(seed)
        args = EngineArgs(max_model_len, gpu_memory_utilization, max_num_seqs,
                          max_num_batched_tokens, enforce_eager, num_speculative_tokens)
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
        self.limits = args.apply(self.runner)  # before profiling: the context may be capped
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
        shutdown(). The other keywords are the Decoder's (vLLM's engine arguments among them),
        checked before anything loads."""
        device = engine_args.device(device)
        unknown = sorted(set(kwargs) - set(inspect.signature(cls.__init__).parameters) - {"self"})
        if unknown:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments {unknown} "
                            "(docs/vllm.md lists the engine arguments served)")
        EngineArgs(**{k: v for k, v in kwargs.items() if k in EngineArgs.__dataclass_fields__})
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
                             seed=self.seed, request_ids=self._ids, limits=self.limits, **kwargs)
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
        """The context in tokens: the target's max_position_embeddings, or max_model_len."""
        return self.runner.max_len

    @property
    def round_log(self) -> list[dict] | None:
        """Every round of the Engine when set to a list (calibration and diagnostics read it)."""
        return self.engine.round_log

    @round_log.setter
    def round_log(self, value):
        self.engine.round_log = value

    # -- generation --------------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True,
                 params=None) -> list[RequestOutput]:
        """prompts: a str, token ids, a vLLM dict prompt ({"prompt": str} or {"prompt_token_ids":
        ids}), or a list of them. sampling_params (or params=, release 0.1's name): one
        SamplingParams for all, or one per prompt. All requests are checked before any work
        starts, so a bad request costs the others nothing. Safe to call from several threads:
        their requests share the Engine's rounds."""
        prompts = prompt_list(prompts)
        sp = _sampling_params(sampling_params, params)
        plist = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params has {len(plist)} entries for {len(prompts)} prompts")
        reqs = [self.engine.make_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        if not reqs:
            return []
        with self._lock:
            eng = self.engine
            eng.reserve(reqs)
            eng.add_all(reqs)
        return eng.drive(reqs, use_tqdm=use_tqdm, desc=f"dspark_rt {self.mode}")

    def chat(self, messages, sampling_params=None, *, use_tqdm=True, params=None,
             chat_template_kwargs=None, add_generation_prompt=True) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them, rendered by
        the target's chat template; chat_template_kwargs: its variables ({"enable_thinking":
        False} for Qwen3); add_generation_prompt: open the assistant's turn (vLLM's default)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer in the target folder")
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        variables = template_kwargs(chat_template_kwargs)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      **variables)
                   for c in conversations(messages)]
        return self.generate(prompts, _sampling_params(sampling_params, params), use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params=None, *, num_pages: int = 512, params=None):
        """Yields the request's new tokens round by round (engine.StepOutput: new_token_ids,
        finished, and the full RequestOutput on the last one). Other open streams of this
        Decoder advance in the same rounds. The arguments are checked here, at the call; the
        request is queued at the first next()."""
        req = self.engine.make_request(unwrap(0, prompt), _sampling_params(sampling_params, params))
        return self._stream(req, num_pages)

    def _stream(self, req, num_pages):
        with self._lock:
            eng = self.engine
            eng.reserve([req], num_pages)
            eng.add(req)
        yield from eng.stream_request(req)


def _sampling_params(sampling_params, params):
    """vLLM's sampling_params= or release 0.1's params= (not both); None: SamplingParams()."""
    if sampling_params is not None and params is not None:
        raise TypeError("pass sampling_params= or params= (its older name), not both")
    sp = sampling_params if sampling_params is not None else params
    return SamplingParams() if sp is None else sp
