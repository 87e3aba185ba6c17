"""The public entry point: Decoder.from_pretrained(target, drafter).generate(prompts, params).

A facade over one Engine (engine/engine.py), which owns the requests and the loop; the Decoder
loads the models, resolves the mode and the policy (profiling the machine once for sync / async)
and sizes the Engine's KV pool to the batches it is given.
"""
import itertools
import threading
from pathlib import Path

import torch

from .checkpoint import resolve_dtype
from .engine import EngineConfig
from .engine.engine import Engine
from .models.drafter import Drafter
from .models.qwen3 import Qwen3Model
from .outputs import RequestOutput
from .policies import Calibration, make_policy
from .policies.sts import CALIBRATION_FILE
from .runner.runner import MODES, Runner
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


def _dtype(dtype, device: torch.device) -> torch.dtype:
    """"auto" / None: bfloat16 on CUDA, float32 elsewhere; else a dtype or its name."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype)


def _calibration(calibration) -> Calibration | None:
    if isinstance(calibration, (str, Path)):
        from .policies.sts import read_temperatures
        calibration = read_temperatures(calibration)
    if isinstance(calibration, (list, tuple)):
        calibration = Calibration(list(calibration))
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a Calibration or a list of per-position "
                         f"temperatures, got {type(calibration).__name__}")
    return calibration


class Decoder:
    """DSpark speculative decoding of a target model with a drafter.

    mode: "ar" (target alone), "dflash" (backbone drafts, all verified) or "dspark" (sequential
    head + confidence-scheduled verification; the default when the drafter has a head).
    policy: "fixed" | "threshold" | "sync" | "async" | "auto" | a VerifyPolicy (used in "dspark"
    mode); "sync" and "async" read sps= (a measured throughput profile or its JSON path); without
    it the runner is profiled once and cached by device identity; "auto" (also decides per round
    whether to draft at all) reads sps=(speculative profile, plain-round profile) likewise. calibration: STS temperatures
    (a Calibration, a list, or the path of a JSON written by dspark_rt.policies.sts or SGLang);
    from_pretrained uses the drafter folder's dspark_calibration.json when none is given.
    calibration_source says which temperatures are in force (a path, "given" or None).
    """

    def __init__(self, target: Qwen3Model, drafter: Drafter | None, tokenizer: Tokenizer | None, *,
                 mode=None, policy="fixed", threshold=0.5, sps=None, calibration=None,
                 page_size=16, seed=0, device="cpu", tensor_parallel=None):
        self.device = torch.device(device)
        self.tensor_parallel = tensor_parallel  # parallel.TensorParallel: the worker ranks
        if mode is None:
            mode = "ar" if drafter is None else (
                "dspark" if drafter.head != "none" or drafter.conf_w is not None else "dflash")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.target, self.drafter, self.tokenizer, self.mode = target, drafter, tokenizer, mode
        self.runner = (Runner(target, drafter, mode, page_size, self.device) if tensor_parallel is None
                       else tensor_parallel.runner(target, drafter, mode, page_size, self.device))
        self.policy = self._policy(policy, threshold, sps) if mode == "dspark" else make_policy("fixed")
        self.calibration = _calibration(calibration)
        self.calibration_source = (str(calibration) if isinstance(calibration, (str, Path)) else
                                   None if calibration is None else "given")
        self.seed = seed
        self._ids = itertools.count()  # request ids and random streams, across this Decoder's Engines
        self._lock = threading.Lock()  # sizing the Engine and queueing a batch happen together
        self.engine = self.new_engine(EngineConfig(num_pages=1, max_num_seqs=1))  # sized by _sized

    def _policy(self, policy, threshold, sps):
        """sync / async: sps= or this machine's profile of speculative rounds; auto also needs
        the profile of plain rounds (sps=(speculative, plain), either None to measure it)."""
        if policy not in ("sync", "async", "auto"):
            return make_policy(policy, **({"threshold": threshold} if policy == "threshold" else {}))
        if not self.runner.has_confidence:
            raise ValueError(f"policy {policy!r} needs a drafter with a confidence head")
        spec, plain = (tuple(sps) if isinstance(sps, (tuple, list)) else (sps, None))
        if self.tensor_parallel is not None and (spec is None or (policy == "auto" and plain is None)):
            raise ValueError(f"policy {policy!r} with tensor_parallel_size > 1 needs sps= (the "
                             "profiler runs on one process; measure it there or pass a table)")
        from .runner.profiling import load_or_profile  # measures real rounds of this machine
        if spec is None:
            spec = load_or_profile(self.runner)
        if policy != "auto":
            return make_policy(policy, sps=spec)
        if plain is None:
            plain = load_or_profile(Runner(self.target, None, "ar", self.runner.page_size, self.device))
        return make_policy(policy, sps=spec, plain=plain)

    @classmethod
    def from_pretrained(cls, target, drafter=None, *, device="cpu", dtype=None,
                        tensor_parallel_size: int = 1, **kwargs):
        """target: a Hugging Face Qwen3 / Llama folder; drafter: a DeepSpec DSpark/DFlash or
        z-lab DFlash folder (or None for plain decoding). Without calibration=, the STS
        temperatures `dspark-rt calibrate` wrote beside the drafter are used when present
        (calibration="none": uncalibrated confidences). tensor_parallel_size=N > 1 shards both
        models over N ranks: this process is rank 0, N - 1 worker processes are started (NCCL
        on CUDA, rank r on cuda:r; gloo on the CPU); see shutdown()."""
        device = torch.device(device)
        cal = kwargs.get("calibration")
        if cal is None and drafter is not None and (Path(drafter) / CALIBRATION_FILE).is_file():
            kwargs["calibration"] = Path(drafter) / CALIBRATION_FILE
        elif isinstance(cal, str) and cal == "none":
            kwargs["calibration"] = None
        dt = _dtype(dtype, device)
        tok = Tokenizer.from_pretrained(target) if (Path(target) / "tokenizer.json").exists() else None
        if tensor_parallel_size != 1:
            if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
                raise ValueError(f"tensor_parallel_size must be a positive int, got "
                                 f"{tensor_parallel_size!r}")
            from .parallel import TensorParallel
            tp = TensorParallel(tensor_parallel_size, target, drafter, dt, device)
            try:
                return cls(tp.target, tp.drafter, tok, device=device, tensor_parallel=tp, **kwargs)
            except BaseException:
                tp.shutdown()
                raise
        tgt = Qwen3Model.from_pretrained(target, dtype=dt, device=device)
        drf = Drafter.from_pretrained(drafter, tgt, dtype=dt, device=device) if drafter else None
        return cls(tgt, drf, tok, device=device, **kwargs)

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
        any work starts, so a bad request costs the others nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params has {len(plist)} entries for {len(prompts)} prompts")
        reqs = [self.engine.make_request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        if not reqs:
            return []
        with self._lock:
            eng = self._sized(reqs)
            eng.add_all(reqs)
        return eng.drive(reqs, use_tqdm=use_tqdm, desc=f"dspark_rt {self.mode}")

    def chat(self, messages, params=None, **kwargs) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer in the target folder")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params, **kwargs)

    def stream(self, prompt, params=None, *, num_pages: int = 512):
        """Yields the request's new tokens round by round (engine.StepOutput: new_token_ids,
        finished, and the full RequestOutput on the last one). Other open streams of this
        Decoder advance in the same rounds."""
        req = self.engine.make_request(prompt, params or SamplingParams())
        with self._lock:
            eng = self._sized([req], num_pages)
            eng.add(req)
        yield from eng.stream_request(req)

    def _sized(self, reqs, min_pages: int = 0) -> Engine:
        """The Engine, its pool resized when idle and too small for these requests' whole
        lifetimes at once (offline batches then run without preemption); while streams are open
        they share the pool as it is (with preemption when short)."""
        eng = self.engine
        seqs, budget = len(reqs), max(8192, len(reqs) * (1 + self.runner.gamma))
        if eng.owns_caches and eng.has_unfinished():
            seqs += len(eng.requests)
            budget = max(budget, seqs * (1 + self.runner.gamma))
        else:
            need = eng.pages_needed(reqs)
            need = max(min_pages, need + need // 50 + 1)  # + the admission watermark
            if not eng.owns_caches or eng.num_pages < need:
                eng = self.new_engine(EngineConfig(num_pages=need, max_num_seqs=seqs,
                                                   max_num_batched_tokens=budget, chunk_size=budget))
        eng.scheduler.max_num_seqs = max(eng.scheduler.max_num_seqs, seqs)
        eng.scheduler.max_num_batched_tokens = max(eng.scheduler.max_num_batched_tokens, budget)
        return eng
