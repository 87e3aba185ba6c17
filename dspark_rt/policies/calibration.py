"""What a caller may pass as calibration= (Decoder, CLI, server), checked at the boundary: a
Calibration, a list of per-position temperatures, or the path of a JSON that sts.py or SGLang
wrote."""
import math
import numbers
from pathlib import Path

from .base import Calibration
from .sts import read_temperatures


def _numbers(v, lo_open=None) -> bool:
    return all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
               and (lo_open is None or x > lo_open) for x in v)


def as_calibration(calibration, gamma: int) -> Calibration | None:
    """calibration as a Calibration with at least gamma finite temperatures > 0 (and biases, when
    given, gamma finite numbers), or None; a ValueError naming what is wrong otherwise."""
    if isinstance(calibration, (str, Path)):
        calibration = read_temperatures(calibration)
    if isinstance(calibration, (list, tuple)):
        calibration = Calibration(list(calibration))
    if calibration is None:
        return None
    if not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a Calibration or a list of per-position "
                         f"temperatures, got {type(calibration).__name__}")
    t = calibration.temperatures
    if not _numbers(t, lo_open=0):
        raise ValueError(f"calibration temperatures must be finite numbers > 0, got {list(t)}")
    if len(t) < gamma:
        raise ValueError(f"calibration has {len(t)} temperatures, the drafter drafts {gamma} "
                         "positions (one temperature each)")
    b = calibration.biases
    if b is not None and (len(b) < gamma or not _numbers(b)):
        raise ValueError(f"calibration biases must be {gamma} finite numbers, got {list(b)}")
    return calibration
