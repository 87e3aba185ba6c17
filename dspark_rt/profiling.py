"""The engine's throughput profile SPS(B), measured on this machine and cached (DESIGN §4).

What one timed call of the step function with B verify tokens runs: a real engine round, with
the same Runner code generate() uses.

* R = ceil(B / (gamma + 1)) requests (ar mode: R = B), taken from a pool of max_batch requests
  whose synthetic prompts (seeded random token ids) of context_len tokens were prefilled once,
  untimed; every request has its anchor set.
* Runner.step: the drafter's block forward for the R requests, the sequential head and the
  confidence head (ops.markov_sample), the target's ragged verify forward over chains of
  1 + l_r tokens with sum_r (1 + l_r) = B (l_r as even as possible, l_r <= gamma) and
  rejection sampling.
* Runner.commit_context: the drafter context update for all 1 + l_r verified positions (an upper
  bound on the accepted prefix a real round commits).

Not timed: the verify-length policy (host numpy, microseconds; here the lengths are fixed) and
the Decoder's per-request Python bookkeeping. A DFlash decoder is profiled as a dspark round
(the same drafter, head "none"), since only dspark mode lets lengths vary.

The requests never advance: kv_len, anchors and drafter context lengths are restored after every
call, so each call overwrites the same scratch KV slots right after the context, and the pool's
KV memory stays at max_batch * (context_len + a block) tokens in each of the two caches.
"""
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from .outputs import SpecMetrics
from .policy import VerifyPolicy
from .request import Request
from .runner import Runner
from .sampling_params import SamplingParams
from .sps import IDENTITY_FIELDS, SPSProfile, check_profile, gpu_state, measure_profile, profile_key

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


def _config_id(cfg) -> str:
    """Folder name and a short hash of the config.json the model was loaded from."""
    src = Path(cfg.source)
    data = src.read_bytes() if src.is_file() else repr(cfg).encode()
    return f"{src.parent.name}@{hashlib.sha256(data).hexdigest()[:12]}"


def model_identity(decoder, context_len: int) -> str:
    """What the profile's rounds ran: target and drafter (name + config hash), mode, the pool's
    context length and, on CPU, the host (a CPU profile has no NVML identity to key on)."""
    parts = [_config_id(decoder.target.config)]
    if decoder.drafter is not None and decoder.mode != "ar":
        parts.append(_config_id(decoder.drafter.config))
    s = "+".join(parts) + f"/{'ar' if decoder.mode == 'ar' else 'dspark'}/ctx{context_len}"
    if decoder.device.type != "cuda":
        s += f"/cpu:{platform.machine()}x{os.cpu_count()}"
    return s


def _gpu(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return gpu_state(device.index if device.index is not None else torch.cuda.current_device()) or {}


class _FixedLengths(VerifyPolicy):
    """The profiler's policy: the lengths it was told to verify (capped as usual)."""
    name = "profile"

    def __init__(self):
        self.next = None

    def lengths(self, c_hat, survival, cap, gamma):
        return torch.minimum(self.next, cap)


class RoundWorkload:
    """A pool of prefilled synthetic requests and `step(B)`: one real round with B verify tokens."""

    def __init__(self, decoder, max_batch: int, context_len: int, seed: int = 0):
        dev = decoder.device
        mode = "ar" if decoder.mode == "ar" else "dspark"
        self.policy = _FixedLengths()
        self.runner = Runner(decoder.target, decoder.drafter, mode, self.policy, None,
                             decoder.runner.page_size, dev)
        self.gamma = gamma = self.runner.gamma
        self.max_tokens = max_batch * (gamma + 1)
        self.sync = torch.cuda.synchronize if dev.type == "cuda" else None
        V = decoder.target.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        # max_tokens = gamma + 2 keeps every request's cap >= gamma (the target token counts too)
        params = SamplingParams(temperature=0, max_tokens=gamma + 2, ignore_eos=True)
        self.reqs = [Request(i, None, torch.randint(0, V, (context_len,), generator=g).tolist(),
                             params, seed, i + 1, SpecMetrics(gamma)) for i in range(max_batch)]
        self.runner.reserve(self.reqs)
        per = max(1, PREFILL_TOKENS // context_len)
        for i in range(0, max_batch, per):
            chunk = self.reqs[i:i + per]
            anchors = self.runner.prefill(chunk).argmax(dim=-1).tolist()
            for r, a in zip(chunk, anchors):
                r.anchor = a

    def step(self, B: int):
        if not 1 <= B <= self.max_tokens:
            raise ValueError(f"B must lie in [1, {self.max_tokens}], got {B}")
        R = -(-B // (self.gamma + 1))
        reqs = self.reqs[:R]
        base, rem = divmod(B - R, R)
        lengths = [base + (i < rem) for i in range(R)]
        self.policy.next = torch.tensor(lengths, dtype=torch.int64)
        res = self.runner.step(reqs)
        self.runner.commit_context(reqs, [r.kv_len for r in reqs], [1 + n for n in res.lengths],
                                   res.features, res.cu_rows[:-1])
        for r in reqs:  # nothing advances: the next call reuses the same scratch slots
            r.ctx_len = r.kv_len

    def release(self):
        for r in self.reqs:
            self.runner.release(r)
        self.runner.tcache = self.runner.dcache = None


def _resolve(decoder, seconds, max_batch, context_len):
    d = _defaults(decoder.device)
    seconds = d["seconds"] if seconds is None else float(seconds)
    max_batch = d["max_batch"] if max_batch is None else int(max_batch)
    gamma = decoder.runner.gamma
    block = decoder.drafter.block_size if decoder.mode != "ar" else 0
    room = decoder.max_model_len - (gamma + 2) - (block + 2)  # the round's chain and block fit
    context_len = min(d["context_len"] if context_len is None else int(context_len), room)
    if seconds <= 0 or max_batch < 1 or context_len < 1:
        raise ValueError(f"need seconds > 0, max_batch >= 1 and a context that fits the model "
                         f"({decoder.max_model_len} positions), got seconds={seconds}, "
                         f"max_batch={max_batch}, context_len={context_len}")
    return seconds, max_batch, context_len


def engine_key(decoder, *, max_batch: int | None = None, context_len: int | None = None) -> dict:
    """The profile_key a profile of this decoder measured now would carry."""
    _, max_batch, context_len = _resolve(decoder, 1.0, max_batch, context_len)
    dtype = str(decoder.target.dtype).removeprefix("torch.")
    return profile_key(model_identity(decoder, context_len), dtype, max_batch=max_batch,
                       max_tokens=max_batch * (decoder.runner.gamma + 1),
                       gpu=_gpu(decoder.device))


def profile_engine(decoder, B_values=None, seconds: float | None = None,
                   context_len: int | None = None, max_batch: int | None = None,
                   progress: bool = True) -> SPSProfile:
    """Measure SPS(B) of this decoder's rounds (see the module docstring for what is timed).

    Defaults: 30 s, 32 requests of 1024 context tokens on CUDA; 3 s, 8 requests of 128 on CPU
    (context_len is clamped to the model's context). B_values default to default_B_values of
    max_batch * (gamma + 1), which is the profile's max_tokens."""
    seconds, max_batch, context_len = _resolve(decoder, seconds, max_batch, context_len)
    key = engine_key(decoder, max_batch=max_batch, context_len=context_len)
    work = RoundWorkload(decoder, max_batch, context_len)
    try:
        B_values = default_B_values(work.max_tokens) if B_values is None else list(B_values)
        bad = [b for b in B_values if not 1 <= int(b) <= work.max_tokens]
        if bad or not B_values:
            raise ValueError(f"B_values must be non-empty and lie in [1, {work.max_tokens}] "
                             f"(max_batch * (gamma + 1)), got {bad or B_values}")
        return measure_profile(work.step, B_values, seconds, progress, sync=work.sync, key=key)
    finally:
        work.release()


def cache_path(key: dict, cache_dir=None) -> Path:
    """One file per identity: <cache_dir>/sps_<hash of IDENTITY_FIELDS>.json; cache_dir defaults
    to $DSPARK_CACHE_DIR or ~/.cache/dspark_rt."""
    cache_dir = Path(cache_dir or os.environ.get("DSPARK_CACHE_DIR") or "~/.cache/dspark_rt")
    ident = json.dumps({f: key.get(f) for f in IDENTITY_FIELDS}, sort_keys=True)
    return cache_dir.expanduser() / f"sps_{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def load_or_profile(decoder, cache_dir=None, *, B_values=None, seconds: float | None = None,
                    context_len: int | None = None, max_batch: int | None = None,
                    progress: bool = True) -> SPSProfile:
    """A cached profile valid for this decoder on this machine now (sps.check_profile: identity,
    SM clock, throttling), else a fresh profile_engine measurement, saved to the cache."""
    key = engine_key(decoder, max_batch=max_batch, context_len=context_len)
    path = cache_path(key, cache_dir)
    if path.is_file():
        try:
            cached = SPSProfile.load(path)
        except (ValueError, KeyError, TypeError) as e:  # corrupt or foreign: measure again
            log.warning("SPS profile %s unreadable (%s): re-profiling", path, e)
        else:
            chk = check_profile(cached, key, gpu=_gpu(decoder.device))
            if chk.profile is not None and not chk.reprofile:
                log.info("SPS profile: reusing %s", path)
                return chk.profile
            log.warning("SPS profile %s: re-profiling (%s)", path, "; ".join(chk.reasons))
    prof = profile_engine(decoder, B_values, seconds, context_len, max_batch, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    log.info("SPS profile saved to %s", path)
    return prof


def profile_command(target, drafter, out=None, *, seconds=None, max_batch=None, context_len=None,
                    device="cpu", dtype=None, progress=True) -> SPSProfile:
    """Measure now (never reuse) and save to `out`, or to the cache load_or_profile reads."""
    from .decoder import Decoder
    dec = Decoder.from_pretrained(target, drafter, device=device, dtype=dtype)
    prof = profile_engine(dec, seconds=seconds, context_len=context_len, max_batch=max_batch,
                          progress=progress)
    path = Path(out) if out is not None else cache_path(prof.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    print(f"SPS(B) of {prof.key['model']} ({prof.key['dtype']}, GPU {prof.key['gpu_name']}), "
          f"rounds/s:")
    for b, v in zip(prof.tokens, prof.rounds_per_s):
        print(f"  B={b:<5d} {v:10.1f}")
    print(f"wrote {path}")
    return prof


def main(argv=None) -> int:
    from .prompts import parse_tool_args, positive, run_tool, tool_parser
    ap = tool_parser("profile", "Measure this machine's throughput profile SPS(B) for a model "
                     "pair (rounds per second against B verify tokens).", prompts=False)
    ap.add_argument("--out", help="JSON path (default: the profile cache, $DSPARK_CACHE_DIR or "
                    "~/.cache/dspark_rt, where eval and load_or_profile find it)")
    ap.add_argument("--seconds", type=positive(float), help="measuring budget (30 GPU / 3 CPU)")
    ap.add_argument("--max-batch", type=positive(int), help="requests in the largest round "
                    "(32 GPU / 8 CPU); max B = max_batch * (gamma + 1)")
    ap.add_argument("--context-len", type=positive(int), help="context tokens per request "
                    "(1024 GPU / 128 CPU)")
    a = parse_tool_args(ap, argv)
    return run_tool(ap, profile_command, a.target, a.drafter, a.out, seconds=a.seconds,
                    max_batch=a.max_batch, context_len=a.context_len, device=a.device,
                    dtype=a.dtype)
