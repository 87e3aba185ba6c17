"""Throughput profile SPS(B): engine rounds per second against B verify tokens (DESIGN §4).

B = sum_r (1 + l_r), the tokens of one verify forward. Real curves are jagged (tile and wave
quantisation), so the profile stays the measured table: a lookup never smooths across measured
points. Between two measured points the default "linear" rule interpolates between the two
neighbours; "step" uses the value of the next measured B' >= B (a round with B tokens charged
like the padded B' round). Step makes every grid point of the measurement a wall for the
synchronous scheduler's early stop (the first token past a grid point pays the whole step), so
use it only for tables measured at every B or at the engine's real padding points. "floor" uses
the last measured B' <= B, SGLang's lookup (tables read by `read_sglang_sps_table`,
sps_files.py). Below the
first point the first value is used; above the last point there is no value (the schedulers
never go there: `max_tokens` is the largest measured B).

The JSON cache is keyed (see `profile_key`) by the GPU's identity from NVML (name, UUID,
driver), the SM clock at profiling time, the model identity string, the dtype and the batch
limits. `check_profile` compares a loaded profile with the machine as it is now.
"""
import json
import logging
import math
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..nvml import nvml_state
from .sps_files import (FORMAT, INTERPS, MAX_RATE, MAX_TOKENS, SGLANG_ADDITIVE_FIELDS,  # noqa: F401
                        SGLANG_SPS_FIELDS, SUPPORTED, Table, parse_sglang_sps_table,
                        parse_sps_file, write_sglang_sps_table)

log = logging.getLogger(__name__)

# Key fields that must match exactly; the SM clock is compared with a tolerance instead.
IDENTITY_FIELDS = ("gpu_name", "gpu_uuid", "driver", "model", "dtype", "max_batch", "max_tokens")
# NVML clock-event reasons that mean the clocks are being pulled down right now.
_THROTTLE_BITS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
                  0x40: "hw_thermal", 0x80: "hw_power_brake"}


@dataclass
class SPSProfile:
    tokens: list[int]            # measured B values, strictly ascending, >= 1
    rounds_per_s: list[float]    # SPS at each measured B, > 0
    key: dict = field(default_factory=dict)
    interp: str = "linear"       # "linear", "step" (next measured point), "floor" (previous one)

    def __post_init__(self):
        self.tokens = [int(b) for b in self.tokens]
        self.rounds_per_s = [float(v) for v in self.rounds_per_s]
        if not self.tokens or len(self.tokens) != len(self.rounds_per_s):
            raise ValueError("SPS profile needs equally many (>= 1) token counts and values, got "
                             f"{len(self.tokens)} and {len(self.rounds_per_s)}")
        if self.tokens[0] < 1 or any(b >= c for b, c in zip(self.tokens, self.tokens[1:])) or \
                self.tokens[-1] > MAX_TOKENS:
            raise ValueError(f"SPS token counts must lie in [1, {MAX_TOKENS}] and be strictly "
                             f"ascending: {reprlib.repr(self.tokens)}")
        if not all(math.isfinite(v) and v > 0 for v in self.rounds_per_s):
            raise ValueError(f"SPS values must be finite and > 0: {reprlib.repr(self.rounds_per_s)}")
        if self.interp not in INTERPS:
            raise ValueError(f"interp must be one of {INTERPS}, got {self.interp!r}")

    @classmethod
    def from_pairs(cls, pairs, key=None, interp="linear") -> "SPSProfile":
        """pairs: iterable of (B, rounds_per_s), any order; duplicates of B are an error."""
        items = pairs.items() if isinstance(pairs, dict) else pairs
        pairs = sorted((int(b), float(v)) for b, v in items)
        return cls([b for b, _ in pairs], [v for _, v in pairs], dict(key or {}), interp)

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def dense(self, max_B: int | None = None) -> np.ndarray:
        """float64 [max_B + 1]: SPS(B) for B = 0..max_B (max_B <= max_tokens; index 0 unused)."""
        max_B = self.max_tokens if max_B is None else int(max_B)
        if max_B > self.max_tokens:
            raise ValueError(f"SPS is measured up to B={self.max_tokens}, asked for {max_B}")
        B = np.arange(max_B + 1)
        xs, ys = np.asarray(self.tokens), np.asarray(self.rounds_per_s)
        if self.interp == "linear":
            return np.interp(B, xs, ys)
        if self.interp == "floor":
            return ys[np.maximum(np.searchsorted(xs, B, side="right") - 1, 0)]
        return ys[np.searchsorted(xs, B, side="left")]

    def __call__(self, B):
        """SPS at B (int or int array), 1 <= B <= max_tokens."""
        arr = np.asarray(B)
        if arr.size and (arr.min() < 1 or arr.max() > self.max_tokens):
            raise ValueError(f"B must lie in [1, {self.max_tokens}], got {B!r}")
        out = self.dense()[arr]
        return float(out) if out.ndim == 0 else out

    def monotone(self) -> "SPSProfile":
        """The closest profile (least squares in seconds per round, pool-adjacent violators)
        whose seconds per round never fall as B grows: a bigger round never costs less, so a dip
        in a noisy measurement is noise, and a scheduler's early stop must not trip on it."""
        blocks = []  # [mean seconds, count], non-decreasing means
        for t in (1.0 / v for v in self.rounds_per_s):
            blocks.append([t, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (a, n), (b, m) = blocks[-2], blocks.pop()
                blocks[-1] = [(a * n + b * m) / (n + m), n + m]
        seconds = [t for t, n in blocks for _ in range(n)]
        return SPSProfile(self.tokens, [1.0 / t for t in seconds], dict(self.key), self.interp)

    def scaled(self, factor: float) -> "SPSProfile":
        return SPSProfile(self.tokens, [v * factor for v in self.rounds_per_s], dict(self.key),
                          self.interp)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": 1, "key": self.key, "interp": self.interp,
                "table": [[b, v] for b, v in zip(self.tokens, self.rounds_per_s)]}

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "SPSProfile":
        """Our JSON (`save`) or SGLang's DSpark SPS cost table (`read_sglang_sps_table`)."""
        return load_sps_file(path)


def gpu_state(index: int = 0) -> dict | None:
    """NVML state of GPU `index` (dspark_rt.nvml) plus active throttle reasons, or None."""
    gpus = nvml_state()
    if index >= len(gpus):
        return None
    state = dict(gpus[index])
    state["throttle_reasons"] = _throttle_reasons(index)
    return state


def _throttle_reasons(index: int) -> list[str]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = int(get(h))
    except Exception:
        return []
    finally:
        pynvml.nvmlShutdown()
    return [name for bit, name in _THROTTLE_BITS.items() if mask & bit]


def profile_key(model: str, dtype: str, *, max_batch: int, max_tokens: int,
                gpu: dict | None = None, device_index: int = 0) -> dict:
    """The cache key of a profile measured now. gpu: a gpu_state() dict (default: read NVML);
    without a GPU the device fields are None (a CPU profile is only valid on CPU)."""
    gpu = gpu_state(device_index) if gpu is None else gpu
    gpu = gpu or {}
    return {"gpu_name": gpu.get("name"), "gpu_uuid": gpu.get("uuid"), "driver": gpu.get("driver"),
            "sm_clock_mhz": gpu.get("sm_clock_mhz"), "model": str(model), "dtype": str(dtype),
            "max_batch": int(max_batch), "max_tokens": int(max_tokens)}


@dataclass
class ProfileCheck:
    profile: SPSProfile | None   # usable profile (possibly clock-rescaled), None if invalid
    reprofile: bool              # the caller should measure again (when it can afford to)
    reasons: list[str]


def check_profile(profile: SPSProfile, expected_key: dict, *, gpu: dict | None = None,
                  clock_tolerance: float = 0.05, rescale: bool = True) -> ProfileCheck:
    """Is a cached profile valid for `expected_key` (profile_key() of now) on the GPU as it is now?

    * identity mismatch (IDENTITY_FIELDS) -> invalid: profile None, reprofile.
    * SM clock now differs from the profiling clock by more than clock_tolerance (relative) ->
      rounds/s rescaled by the clock ratio (a verify round is compute bound to first order) if
      `rescale`, else reprofile.
    * throttle reasons active now -> keep the profile, flag reprofile (clocks are not stable).
    gpu: a gpu_state() dict (default: read NVML). Every finding is logged with `logging`.
    """
    reasons = []
    for f in IDENTITY_FIELDS:
        if profile.key.get(f) != expected_key.get(f):
            reasons.append(f"{f}: cached {profile.key.get(f)!r} != current {expected_key.get(f)!r}")
    if reasons:
        for r in reasons:
            log.warning("SPS profile invalid, %s", r)
        return ProfileCheck(None, True, reasons)
    gpu = gpu_state() if gpu is None else gpu
    out, reprofile = profile, False
    then, now = profile.key.get("sm_clock_mhz"), (gpu or {}).get("sm_clock_mhz")
    if then and now and abs(now / then - 1.0) > clock_tolerance:
        if rescale:
            out = profile.scaled(now / then)
            out.key["sm_clock_mhz"] = now
            reasons.append(f"SM clock {then} -> {now} MHz: SPS rescaled by {now / then:.3f}")
        else:
            reprofile = True
            reasons.append(f"SM clock {then} -> {now} MHz: re-profile")
    throttle = (gpu or {}).get("throttle_reasons") or []
    if throttle:
        reprofile = True
        reasons.append(f"clock throttling active ({', '.join(throttle)}): re-profile when stable")
    for r in reasons:
        log.warning("SPS profile: %s", r)
    return ProfileCheck(out, reprofile, reasons)


def measure_profile(step_fn, B_values, seconds_budget: float, progress: bool = True, *,
                    warmup: int = 2, min_repeats: int = 3, sync=None, key=None,
                    interp: str = "linear") -> SPSProfile:
    """Time `step_fn(B)` (one engine round with B verify tokens) for every B in B_values;
    SPS(B) = 1 / median call time. See measure_profiles (this is its one-table case)."""
    return measure_profiles({"sps": (step_fn, B_values, key)}, seconds_budget, progress,
                            warmup=warmup, min_repeats=min_repeats, sync=sync, interp=interp)["sps"]


def measure_profiles(steps: dict, seconds_budget: float, progress: bool = True, *,
                     warmup: int = 2, min_repeats: int = 3, sync=None,
                     interp: str = "linear") -> dict:
    """Several profiles measured together: steps maps a name to (step_fn, B_values, key).

    Every call is one sample of one (name, B); the samples are taken in passes over every
    (name, B), each pass in a fresh random order, until seconds_budget is spent and at least
    min_repeats passes are done (after `warmup` untimed passes). A machine whose load drifts
    during the measurement so slows every table alike: the ratios between the tables, which a
    policy decides on, stay right even where the absolute rates do not. step_fn must return only
    when the round is done, or pass sync (e.g. torch.cuda.synchronize), called after every call.
    Returns {name: SPSProfile} (1 / median call time per B)."""
    cells = [(name, int(B)) for name, (_, Bs, _) in steps.items() for B in sorted({int(b) for b in Bs})]
    rng = np.random.default_rng(0)
    times = {c: [] for c in cells}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=round(seconds_budget, 1), desc="SPS profile", unit="s")

    def one_pass(timed: bool):
        for j in rng.permutation(len(cells)):
            name, B = cells[j]
            t0 = time.perf_counter()
            steps[name][0](B)
            if sync:
                sync()
            if timed:
                times[(name, B)].append(time.perf_counter() - t0)

    for _ in range(warmup):
        one_pass(False)
    passes, start = 0, time.perf_counter()
    while passes < min_repeats or time.perf_counter() - start < seconds_budget:
        one_pass(True)
        passes += 1
        if bar is not None:
            bar.n = round(min(time.perf_counter() - start, seconds_budget), 1)
            bar.refresh()
    if bar is not None:
        bar.close()
    out = {}
    for name, (_, _, key) in steps.items():
        table = [(B, 1.0 / max(float(np.median(times[(n, B)])), 1e-12)) for n, B in cells if n == name]
        out[name] = SPSProfile.from_pairs(table, key, interp)
    return out



def _profile(table: Table, path) -> "SPSProfile":
    try:
        return SPSProfile.from_pairs(table.pairs, table.key, table.interp)
    except ValueError as e:
        raise ValueError(f"{path}: field 'table': {e}") from None


def load_sps_file(path) -> "SPSProfile":
    """Our JSON (SPSProfile.save) or SGLang's DSpark SPS cost table (read_sglang_sps_table);
    every field checked where it is read (sps_files.py)."""
    return _profile(parse_sps_file(path), path)


def read_sglang_sps_table(path, key=None) -> "SPSProfile":
    """SGLang's DSpark SPS cost table (`SpsCostTable`, the file behind its
    `--speculative-dspark-sps-table-path`) as a profile with interp="floor": sps_files.py's
    parse_sglang_sps_table says what is read and how SGLang looks it up."""
    return _profile(parse_sglang_sps_table(path, key), path)
