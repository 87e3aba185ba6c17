"""The machine's throughput profile SPS(B) of a model pair's rounds, measured and cached
(DESIGN §4).

What one timed call of the step function with B verify tokens runs: a real Round, the code the
engine serves with, on a Runner of its own built from the model pair.

* R = ceil(B / (gamma + 1)) requests (ar mode: R = B), taken from a pool of max_batch requests
  whose synthetic prompts (seeded random token ids) of context_len tokens were prefilled once,
  untimed.
* The round: the drafter's block forward for the R requests, the sequential head and the
  confidence head (ops.markov_sample), the target's ragged verify forward over chains of
  1 + l_r tokens with sum_r (1 + l_r) = B (l_r as even as possible, l_r <= gamma), rejection
  sampling, the one host read and the drafter context update of the accepted positions.

Not timed: the verify-length policy (host numpy, microseconds; here the lengths are fixed) and
the engine's per-request Python bookkeeping. A DFlash pair is profiled as a dspark round (the
same drafter, head "none"), since only dspark mode lets lengths vary.

The requests never advance: every call overwrites the same scratch KV slots right after the
context, so the pool's KV memory stays at max_batch * (context_len + a block) tokens per cache.
"""
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from ..policies import Calibration, Decision, VerifyPolicy
from ..policies.sps import (IDENTITY_FIELDS, SPSProfile, check_profile, gpu_state, measure_profiles,
                           profile_key)
from ..sampling_params import SamplingParams
from ..batch import SamplingBatch, SeqBatch, pages_for
from .round import Round, first_token
from .runner import Runner

log = logging.getLogger(__name__)

PREFILL_TOKENS = 8192  # per prefill forward while building the pool: bounds activation memory


def _defaults(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"seconds": 30.0, "max_batch": 32, "context_len": 1024}
    return {"seconds": 3.0, "max_batch": 8, "context_len": 128}


def default_B_values(max_tokens: int) -> list[int]:
    """Every B up to 32, every 4th up to 128, every 16th beyond, and max_tokens itself: dense
    where one token changes the round's cost most, and always the largest B a scheduler may use."""
    grid = list(range(1, 33)) + list(range(36, 129, 4)) + list(range(144, max_tokens + 1, 16))
    return sorted({b for b in grid if b <= max_tokens} | {max_tokens})


def sparse_B_values(max_tokens: int) -> list[int]:
    """Powers of two up to max_tokens, and max_tokens: a quick profile of a large model on a slow
    machine (the monotone fit reads between the points)."""
    return sorted({1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens} | {max_tokens})


def _config_id(cfg) -> str:
    """Folder name and a short hash of the config.json the model was loaded from."""
    src = Path(cfg.source)
    data = src.read_bytes() if src.is_file() else repr(cfg).encode()
    return f"{src.parent.name}@{hashlib.sha256(data).hexdigest()[:12]}"


SHAPES = ("spread", "no_drafts", "context")
_MODES = {"spread": "dspark", "no_drafts": "dspark-no-drafts", "context": "dspark-context"}


def model_identity(runner: Runner, context_len: int, shape: str = "spread") -> str:
    """What the profile's rounds ran: target and drafter (name + config hash), mode, the round
    shape, the pool's context length and, on CPU, the host (a CPU profile has no NVML identity to
    key on)."""
    parts = [_config_id(runner.target.config)]
    if runner.drafter is not None:
        parts.append(_config_id(runner.drafter.config))
    mode = "ar" if runner.mode == "ar" else _MODES[shape]
    s = "+".join(parts) + f"/{mode}/ctx{context_len}"
    if runner.device.type != "cuda":  # the CPU model, its cores and the torch threads used
        s += f"/cpu:{_cpu_model()}:{platform.machine()}x{os.cpu_count()}/threads{torch.get_num_threads()}"
    return s


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _gpu(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return gpu_state(device.index if device.index is not None else torch.cuda.current_device()) or {}


class _FixedLengths(VerifyPolicy):
    """The profiler's policy: every request drafts, and verifies the lengths it was told (capped
    as usual), after the confidences' host read that sync and auto rounds pay too."""
    name = "profile"

    def __init__(self):
        self.next = None

    def lengths(self, decision, c_hat, survival, cap):
        return torch.minimum(self.next, cap)


class RoundWorkload:
    """A pool of prefilled synthetic requests and `step(B)`: one real round with B verify tokens,
    on a Runner of its own over `runner`'s models (the engine's caches are untouched).
    shape "spread": R = ceil(B / (gamma + 1)) requests share B - R drafts; "no_drafts": B
    requests that draft and verify none (the cost of drafting for B requests, AutoPolicy);
    "context": not a round but the drafter context update of B positions, as few requests
    holding as many positions each as the pool's context allows (what a request that drafts
    after a plain stretch writes first, runner/round.py; AutoPolicy prices exploring with it)."""

    def __init__(self, runner: Runner, max_batch: int, context_len: int, seed: int = 0,
                 shape: str = "spread"):
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
        self.shape = shape
        mode = "ar" if runner.mode == "ar" else "dspark"
        self.runner = r = Runner(runner.target, runner.drafter, mode, runner.page_size, runner.device)
        self.policy, self.calibration, self.round = _FixedLengths(), Calibration.identity(max(r.gamma, 1)), Round()
        self.gamma = gamma = r.gamma
        if shape != "spread" and runner.drafter is None:
            raise ValueError(f"shape {shape!r} needs a drafter (mode {runner.mode!r} has none)")
        self.max_tokens = max_batch if shape == "no_drafts" else max_batch * (gamma + 1)
        self.room = context_len + gamma + 1  # positions a pool request's pages hold
        self.sync = torch.cuda.synchronize if r.device.type == "cuda" else None
        V = r.target.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        # every request holds context_len positions plus a round's chain or block: pages in a row
        per = pages_for(context_len + max(gamma + 1, r.block_size) + 1, r.page_size)
        r.allocate_caches(max_batch * per)
        pages = [list(range(i * per, (i + 1) * per)) for i in range(max_batch)]
        params = SamplingBatch.of([SamplingParams(temperature=0)] * max_batch)
        prompts = [torch.randint(0, V, (context_len,), generator=g).tolist() for _ in range(max_batch)]
        self.batch = SeqBatch([context_len] * max_batch, [context_len] * max_batch, pages, pages,
                              [0] * max_batch, [gamma] * max_batch, params, [seed] * max_batch,
                              list(range(1, max_batch + 1)), [1] * max_batch)
        chunk = max(1, PREFILL_TOKENS // context_len)
        for i in range(0, max_batch, chunk):
            rows = list(range(i, min(i + chunk, max_batch)))
            b = self.batch.select(rows)
            logits = r.prefill(b, [0] * len(rows), [context_len] * len(rows),
                               [prompts[j] for j in rows])
            _, toks, _ = first_token(r, b, logits)
            for j, t in zip(rows, toks):
                self.batch.anchors[j] = t[0]
        if shape == "context":  # target features of max_tokens positions, drawn once
            width = r.target.config.hidden_size * len(r.capture)
            self.features = torch.randn(self.max_tokens, width, generator=g).to(r.device, r.target.dtype)

    def step(self, B: int):
        if not 1 <= B <= self.max_tokens:
            raise ValueError(f"B must lie in [1, {self.max_tokens}], got {B}")
        if self.shape == "context":  # positions 0.. of the first requests, rewritten in place
            per = min(B, self.room)
            counts = [per] * (B // per) + ([B % per] if B % per else [])
            pages = self.batch.drafter_pages[: len(counts)]
            self.runner.context_update(pages, [0] * len(counts), counts, self.features[:B],
                                       [i * per for i in range(len(counts))])
            return
        R = -(-B // (self.gamma + 1)) if self.shape == "spread" else B
        base, rem = divmod(B - R, R)
        self.policy.next = torch.tensor([base + (i < rem) for i in range(R)], dtype=torch.int64)
        self.round(self.runner, self.batch.select(list(range(R))), Decision((self.gamma,) * R),
                   self.policy, self.calibration)

    def release(self):
        self.runner.tcache = self.runner.dcache = None


def _resolve(runner: Runner, seconds, max_batch, context_len):
    d = _defaults(runner.device)
    seconds = d["seconds"] if seconds is None else float(seconds)
    max_batch = d["max_batch"] if max_batch is None else int(max_batch)
    room = runner.max_len - (runner.gamma + 2) - (runner.block_size + 2)  # chain and block fit
    context_len = min(d["context_len"] if context_len is None else int(context_len), room)
    if not 0 < seconds < float("inf") or max_batch < 1 or context_len < 1:
        raise ValueError(f"need finite seconds > 0, max_batch >= 1 and a context that fits the "
                         f"model ({runner.max_len} positions), got seconds={seconds}, "
                         f"max_batch={max_batch}, context_len={context_len}")
    return seconds, max_batch, context_len


def runner_key(runner: Runner, *, max_batch: int | None = None, context_len: int | None = None,
               shape: str = "spread") -> dict:
    """The profile_key a profile of this runner's model pair measured now would carry."""
    _, max_batch, context_len = _resolve(runner, 1.0, max_batch, context_len)
    dtype = str(runner.target.dtype).removeprefix("torch.")
    per = 1 if shape == "no_drafts" else runner.gamma + 1
    return profile_key(model_identity(runner, context_len, shape), dtype, max_batch=max_batch,
                       max_tokens=max_batch * per, gpu=_gpu(runner.device))


def profile_runner(runner: Runner, B_values=None, seconds: float | None = None,
                   context_len: int | None = None, max_batch: int | None = None,
                   progress: bool = True, shape: str = "spread") -> SPSProfile:
    """Measure SPS(B) of rounds of this runner's model pair (see the module docstring; shape:
    RoundWorkload's).

    Defaults: 30 s, 32 requests of 1024 context tokens on CUDA; 3 s, 8 requests of 128 on CPU
    (context_len is clamped to the model's context). B_values default to default_B_values of
    max_batch * (gamma + 1), which is the profile's max_tokens."""
    return profile_runners([(runner, shape)], B_values, seconds, context_len, max_batch, progress)[0]


def profile_runners(items, B_values=None, seconds: float | None = None,
                    context_len: int | None = None, max_batch: int | None = None,
                    progress: bool = True, sparse: bool = False) -> list[SPSProfile]:
    """Profiles of several (runner, shape) pairs measured together, their rounds interleaved
    (sps.measure_profiles), in one budget of `seconds`: a load that comes and goes on the machine
    meanwhile slows them alike, so the ratios between them (what AutoPolicy decides on) hold.
    sparse: sparse_B_values instead of default_B_values where B_values is None."""
    steps, works = {}, []
    try:
        for i, (runner, shape) in enumerate(items):
            sec, mb, ctx = _resolve(runner, seconds, max_batch, context_len)
            key = runner_key(runner, max_batch=mb, context_len=ctx, shape=shape)
            work = RoundWorkload(runner, mb, ctx, shape=shape)
            works.append(work)
            grid = sparse_B_values if sparse else default_B_values
            Bs = grid(work.max_tokens) if B_values is None else list(B_values)
            bad = [b for b in Bs if not 1 <= int(b) <= work.max_tokens]
            if bad or not Bs:
                raise ValueError(f"B_values must be non-empty and lie in [1, {work.max_tokens}] "
                                 f"(max_batch * (gamma + 1)), got {bad or Bs}")
            steps[i] = (work.step, Bs, key)
        sync = works[0].sync if works else None
        # one untimed pass: the pool was prefilled when the workloads were built
        out = measure_profiles(steps, sec, progress, sync=sync, warmup=1)
        return [out[i] for i in range(len(items))]
    finally:
        for work in works:
            work.release()


def cache_path(key: dict, cache_dir=None) -> Path:
    """One file per identity: <cache_dir>/sps_<hash of IDENTITY_FIELDS>.json; cache_dir defaults
    to $DSPARK_CACHE_DIR or ~/.cache/dspark_rt."""
    cache_dir = Path(cache_dir or os.environ.get("DSPARK_CACHE_DIR") or "~/.cache/dspark_rt")
    ident = json.dumps({f: key.get(f) for f in IDENTITY_FIELDS}, sort_keys=True)
    return cache_dir.expanduser() / f"sps_{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def load_or_profile(runner: Runner, cache_dir=None, *, B_values=None, seconds: float | None = None,
                    context_len: int | None = None, max_batch: int | None = None,
                    progress: bool = True, shape: str = "spread", sparse: bool = False) -> SPSProfile:
    """A cached profile valid for this model pair on this machine now (sps.check_profile:
    identity, SM clock, throttling), else a fresh profile_runner measurement, saved to the cache."""
    return load_or_profile_jointly([(runner, shape)], cache_dir, B_values=B_values, seconds=seconds,
                                   context_len=context_len, max_batch=max_batch, progress=progress,
                                   sparse=sparse)[0]


def load_or_profile_jointly(items, cache_dir=None, *, B_values=None, seconds: float | None = None,
                            context_len: int | None = None, max_batch: int | None = None,
                            progress: bool = True, sparse: bool = False) -> list[SPSProfile]:
    """load_or_profile of several (runner, shape) pairs; those not validly cached are measured
    together (profile_runners), so the ratios between them come from one stretch of time."""
    found, missing = [None] * len(items), []
    for i, (runner, shape) in enumerate(items):
        key = runner_key(runner, max_batch=max_batch, context_len=context_len, shape=shape)
        found[i] = _cached(cache_path(key, cache_dir), key, runner)
        if found[i] is None:
            missing.append(i)
    if missing:
        fresh = profile_runners([items[i] for i in missing], B_values, seconds, context_len,
                                max_batch, progress, sparse)
        for i, prof in zip(missing, fresh):
            path = cache_path(prof.key, cache_dir)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.save(path)
                log.info("SPS profile saved to %s", path)
            except OSError as e:  # an unusable cache (a file in the way, read-only): go on
                if path.parent not in _unusable:
                    _unusable.add(path.parent)
                    log.warning("SPS profile cache %s (DSPARK_CACHE_DIR) is unusable (%s): "
                                "profiles are not cached", path.parent, e.strerror or e)
            found[i] = prof
    return found


_unusable: set[Path] = set()  # cache folders already warned about


def _cached(path: Path, key: dict, runner: Runner) -> SPSProfile | None:
    if not path.is_file():
        return None
    try:
        cached = SPSProfile.load(path)
    except (ValueError, KeyError, TypeError, OSError) as e:  # corrupt, foreign, unreadable
        log.warning("SPS profile %s unreadable (%s): re-profiling", path, e)
        return None
    chk = check_profile(cached, key, gpu=_gpu(runner.device))
    if chk.profile is not None and not chk.reprofile:
        log.info("SPS profile: reusing %s", path)
        return chk.profile
    log.warning("SPS profile %s: re-profiling (%s)", path, "; ".join(chk.reasons))
    return None
