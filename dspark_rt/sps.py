"""Throughput profile SPS(B): engine rounds per second against B verify tokens (DESIGN §4).

B = sum_r (1 + l_r), the tokens of one verify forward. Real curves are jagged (tile and wave
quantisation), so the profile stays the measured table: a lookup never smooths across measured
points. Between two measured points the default "linear" rule interpolates between the two
neighbours; "step" uses the value of the next measured B' >= B (a round with B tokens charged
like the padded B' round). Step makes every grid point of the measurement a wall for the
synchronous scheduler's early stop (the first token past a grid point pays the whole step), so
use it only for tables measured at every B or at the engine's real padding points. Below the
first point the first value is used; above the last point there is no value (the schedulers
never go there: `max_tokens` is the largest measured B).

The JSON cache is keyed (see `profile_key`) by the GPU's identity from NVML (name, UUID,
driver), the SM clock at profiling time, the model identity string, the dtype and the batch
limits. `check_profile` compares a loaded profile with the machine as it is now.
"""
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .env_info import nvml_state

log = logging.getLogger(__name__)

FORMAT = "dspark_rt.sps"
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
    interp: str = "linear"       # "linear" or "step" (next measured point)

    def __post_init__(self):
        self.tokens = [int(b) for b in self.tokens]
        self.rounds_per_s = [float(v) for v in self.rounds_per_s]
        if not self.tokens or len(self.tokens) != len(self.rounds_per_s):
            raise ValueError("SPS profile needs equally many (>= 1) token counts and values, got "
                             f"{len(self.tokens)} and {len(self.rounds_per_s)}")
        if self.tokens[0] < 1 or any(b >= c for b, c in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"SPS token counts must be >= 1 and strictly ascending: {self.tokens}")
        if not all(math.isfinite(v) and v > 0 for v in self.rounds_per_s):
            raise ValueError(f"SPS values must be finite and > 0: {self.rounds_per_s}")
        if self.interp not in ("step", "linear"):
            raise ValueError(f"interp must be 'step' or 'linear', got {self.interp!r}")

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
        return ys[np.searchsorted(xs, B, side="left")]

    def __call__(self, B):
        """SPS at B (int or int array), 1 <= B <= max_tokens."""
        arr = np.asarray(B)
        if arr.size and (arr.min() < 1 or arr.max() > self.max_tokens):
            raise ValueError(f"B must lie in [1, {self.max_tokens}], got {B!r}")
        out = self.dense()[arr]
        return float(out) if out.ndim == 0 else out

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
        d = json.loads(Path(path).read_text())
        if d.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format={d.get('format')!r}); "
                             "use read_sglang_table for other tables")
        return cls.from_pairs(d["table"], d.get("key"), d.get("interp", "linear"))


def gpu_state(index: int = 0) -> dict | None:
    """NVML state of GPU `index` (env_info.nvml_state) plus active throttle reasons, or None."""
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


def read_sglang_table(path, unit: str = "auto", key=None, interp="linear") -> SPSProfile:
    """Read an SPS table as SGLang's DSpark scheduler keeps it (format assumed, tolerant):

    * JSON: {"B": value, ...}; [[B, value], ...]; [{"<tokens>": B, "<value>": v}, ...] (the key
      holding "token"/"batch" is B, the other the value); or any of these under one key of an
      outer object (e.g. {"table": ...}, {"sps": ...}).
    * text: two columns per line (comma, tab or spaces), '#' comments, optional header line.
    unit of the values: "rounds_per_s", "seconds" (per round), "ms" (per round) or "auto": a
    header / key name with "ms" -> ms, with "sec", "time" or "latency" -> seconds, with "sps",
    "per_s" or "throughput" -> rounds/s; without a name, values all below 1 are seconds per round
    (neither a round of a second nor under one round per second is plausible), else rounds/s.
    """
    text = Path(path).read_text()
    try:
        pairs, name = _json_pairs(json.loads(text))
    except json.JSONDecodeError:
        pairs, name = _text_pairs(text)
    if not pairs:
        raise ValueError(f"{path}: no (B, value) pairs found")
    if unit == "auto":
        n = (name or "").lower()
        if re.search(r"(^|[^a-z])ms([^a-z]|$)|msec|millis", n):
            unit = "ms"
        elif any(s in n for s in ("sps", "per_s", "throughput", "rounds_per")):
            unit = "rounds_per_s"
        elif any(s in n for s in ("sec", "time", "latency")):
            unit = "seconds"
        else:
            unit = "seconds" if max(v for _, v in pairs) < 1.0 else "rounds_per_s"
    conv = {"rounds_per_s": lambda v: v, "seconds": lambda v: 1.0 / v, "ms": lambda v: 1e3 / v}
    if unit not in conv:
        raise ValueError(f"unit must be auto, rounds_per_s, seconds or ms, got {unit!r}")
    return SPSProfile.from_pairs([(b, conv[unit](v)) for b, v in pairs], key, interp)


def _json_pairs(d):
    if isinstance(d, dict):
        if d and all(_is_number(k) for k in d):
            return [(int(float(k)), float(v)) for k, v in d.items()], None
        for k, v in d.items():
            if isinstance(v, (dict, list)):
                pairs, name = _json_pairs(v)
                if pairs:
                    return pairs, name or k
        return [], None
    if isinstance(d, list) and d and all(isinstance(e, dict) for e in d):
        keys = list(d[0])
        bkey = next((k for k in keys if "token" in k.lower() or "batch" in k.lower()), keys[0])
        vkey = next(k for k in keys if k != bkey)
        return [(int(e[bkey]), float(e[vkey])) for e in d], vkey
    if isinstance(d, list):
        return [(int(b), float(v)) for b, v in d], None
    return [], None


def _text_pairs(text):
    pairs, name = [], None
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        cols = [c for c in re.split(r"[,\t ;]+", line) if c]
        if len(cols) < 2:
            continue
        if not (_is_number(cols[0]) and _is_number(cols[1])):
            if not pairs:
                name = cols[1]  # header
            continue
        pairs.append((int(float(cols[0])), float(cols[1])))
    return pairs, name


def _is_number(s) -> bool:
    try:
        float(s)
        return True
    except (TypeError, ValueError):
        return False


def measure_profile(step_fn, B_values, seconds_budget: float, progress: bool = True, *,
                    warmup: int = 2, min_repeats: int = 3, sync=None, key=None,
                    interp: str = "linear") -> SPSProfile:
    """Time `step_fn(B)` (one engine round with B verify tokens) for every B in B_values.

    Per B: `warmup` untimed calls, then timed calls until the B's share of seconds_budget is
    spent (at least min_repeats); SPS(B) = 1 / median call time. step_fn must return only when
    the round is done, or pass sync (e.g. torch.cuda.synchronize), called after every call.
    """
    B_values = sorted({int(b) for b in B_values})
    share = seconds_budget / max(1, len(B_values))
    it = B_values
    if progress:
        from tqdm import tqdm
        it = tqdm(B_values, desc="SPS profile", unit="B")
    table = []
    for B in it:
        for _ in range(warmup):
            step_fn(B)
            if sync:
                sync()
        times, start = [], time.perf_counter()
        while len(times) < min_repeats or time.perf_counter() - start < share:
            t0 = time.perf_counter()
            step_fn(B)
            if sync:
                sync()
            times.append(time.perf_counter() - t0)
        table.append((B, 1.0 / max(float(np.median(times)), 1e-12)))
    return SPSProfile.from_pairs(table, key, interp)
