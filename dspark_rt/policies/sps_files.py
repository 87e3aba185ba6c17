"""SPS tables on disk: dspark_rt's JSON (SPSProfile.save) and SGLang's DSpark SPS cost table
(`SpsCostTable`), read with every field checked and every number bounded (MAX_TOKENS,
MAX_RATE); errors are ValueErrors naming the file and the field. The readers return the table as
plain data, a `Table`; sps.py builds the SPSProfile (this module sits below it and imports
nothing of it)."""
import json
import math
import reprlib
from pathlib import Path

from typing import NamedTuple

__all__ = ["parse_sps_file", "parse_sglang_sps_table", "write_sglang_sps_table", "Table",
           "SUPPORTED", "SGLANG_SPS_FIELDS", "SGLANG_ADDITIVE_FIELDS", "FORMAT", "INTERPS",
           "MAX_TOKENS", "MAX_RATE"]

FORMAT = "dspark_rt.sps"
INTERPS = ("linear", "step", "floor")
# Every number a table holds is bounded where it is read: B counts the tokens of one verify
# forward (2**20 is far past any batch; lookups hold 8 bytes per B up to the largest), and no
# engine runs a billion rounds a second (files only: a measurement of a no-op step may).
MAX_TOKENS = 1 << 20
MAX_RATE = 1e9


class Table(NamedTuple):
    """An SPS table as read: (B, rounds_per_s) pairs, its cache key and lookup."""
    pairs: list
    key: dict
    interp: str

# SGLang's DSpark SPS cost table (see read_sglang_sps_table) and its additive variant.
SGLANG_SPS_FIELDS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")
SGLANG_ADDITIVE_FIELDS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")


def parse_sps_file(path) -> Table:
    """Our JSON (SPSProfile.save) or SGLang's DSpark SPS cost table (parse_sglang_sps_table)."""
    d = _read_json_object(path)
    if d.get("format") == FORMAT:
        return _from_own(d, path)
    if any(f in d for f in SGLANG_SPS_FIELDS + SGLANG_ADDITIVE_FIELDS):
        return _from_sglang(d, path)
    raise ValueError(f"{path}: not an SPS table in a supported format ({SUPPORTED}); "
                     f"found top-level fields {sorted(d)}")


SUPPORTED = (f'dspark_rt\'s own JSON ("format": "{FORMAT}") and SGLang\'s DSpark SPS cost table '
             f'(an object with {", ".join(SGLANG_SPS_FIELDS)})')


def parse_sglang_sps_table(path, key=None) -> Table:
    """SGLang's DSpark SPS cost table, the file behind its `--speculative-dspark-sps-table-path`.

    Source: sgl-project/sglang, python/sglang/srt/speculative/dspark_components/dspark_sps.py
    (also dspark_sps_table.py in some revisions): class `SpsCostTable`, written by the profiler
    sglang/benchmark/dspark_sps_profiler.py and read by `load_sps_table_from_path`; the verify
    budget planner (dspark_scheduler.py) looks it up. One JSON object:

    * `sample_batch_tokens` [int]: the probed B, tokens of one verify forward (requests plus
      verified drafts, our B = sum_r (1 + l_r)); strictly increasing, unique.
    * `sample_steps_per_sec` [float]: decode steps (our rounds) per second measured at each B.
    * `max_batch_tokens` int: the largest B the table answers for, >= the last probe.

    SGLang keys the table by B alone (no GPU, model or dtype: the file is simply the one passed
    on the command line) and looks B up by floor: the last probe <= B, the first probe's value
    below it, the last probe's value up to max_batch_tokens. The profile returned has
    interp="floor" and, when max_batch_tokens lies past the last probe, a point there holding
    the last value, so every B in [1, max_batch_tokens] reads what SGLang reads. key: our cache
    key to attach (the file carries none). Other fields are ignored, as SGLang's decoder does.

    SGLang's other cost model, `SpsAdditiveCostTable` (bias_seconds, bs_probes/alpha_seconds,
    m_probes/theta_seconds: a step time from the request count and the token count apart), has
    no SPS(B) equivalent and is refused with an error.
    """
    return _from_sglang(_read_json_object(path), path, key)


def write_sglang_sps_table(profile, path) -> Path:
    """Write `profile` (an SPSProfile) as SGLang's `SpsCostTable` JSON (see
    parse_sglang_sps_table).

    A "floor" profile is written as its points (a trailing point repeating the value before it,
    as read_sglang_sps_table adds, becomes max_batch_tokens again); any other profile as its
    value at every B in [1, max_tokens], so SGLang's floor lookup reads exactly our SPS(B).
    """
    if profile.interp == "floor":
        tokens, values = list(profile.tokens), list(profile.rounds_per_s)
        if len(tokens) > 1 and values[-1] == values[-2]:
            tokens, values = tokens[:-1], values[:-1]
    else:
        tokens = list(range(1, profile.max_tokens + 1))
        values = [float(v) for v in profile.dense()[1:]]
    d = {"sample_batch_tokens": tokens, "sample_steps_per_sec": values,
         "max_batch_tokens": profile.max_tokens}
    path = Path(path)
    path.write_text(json.dumps(d) + "\n")
    return path


def _read_json_object(path) -> dict:
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e}); supported: {SUPPORTED}") from None
    except RecursionError:
        raise ValueError(f"{path}: not readable JSON (nested deeper than the interpreter's "
                         f"recursion limit); supported: {SUPPORTED}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: top level is a {type(d).__name__}, expected an object; "
                         f"supported: {SUPPORTED}")
    return d


def _from_sglang(d: dict, path, key=None) -> Table:
    if any(f in d for f in SGLANG_ADDITIVE_FIELDS):
        raise ValueError(f"{path}: SGLang's additive cost table "
                         f"({', '.join(SGLANG_ADDITIVE_FIELDS)}) prices a round by request count "
                         "and token count separately; dspark_rt's SPS(B) has no request axis, so "
                         f"it is not supported. Supported: {SUPPORTED}")
    for f in SGLANG_SPS_FIELDS:
        if f not in d:
            raise ValueError(f"{path}: SGLang SPS table lacks field {f!r}")
    tokens = _numbers(d, "sample_batch_tokens", path, int, MAX_TOKENS)
    values = [float(v) for v in _numbers(d, "sample_steps_per_sec", path, (int, float), MAX_RATE)]
    max_bt = d["max_batch_tokens"]
    if not isinstance(max_bt, int) or isinstance(max_bt, bool):
        raise ValueError(f"{path}: field 'max_batch_tokens' must be an integer, got {max_bt!r}")
    if not 1 <= max_bt <= MAX_TOKENS:
        raise ValueError(f"{path}: field 'max_batch_tokens' must lie in [1, {MAX_TOKENS}], "
                         f"got {max_bt}")
    if not tokens:
        raise ValueError(f"{path}: field 'sample_batch_tokens' is empty")
    if len(tokens) != len(values):
        raise ValueError(f"{path}: fields 'sample_batch_tokens' and 'sample_steps_per_sec' differ "
                         f"in length ({len(tokens)} vs {len(values)})")
    if tokens[0] < 1 or any(b >= c for b, c in zip(tokens, tokens[1:])):
        raise ValueError(f"{path}: field 'sample_batch_tokens' must be >= 1 and strictly "
                         f"increasing, got {tokens}")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{path}: field 'sample_steps_per_sec' must be finite and > 0, "
                         f"got {values}")
    if max_bt < tokens[-1]:
        raise ValueError(f"{path}: field 'max_batch_tokens' ({max_bt}) is below the last probe "
                         f"{tokens[-1]}")
    if max_bt > tokens[-1]:  # SGLang's floor lookup holds the last value up to max_batch_tokens
        tokens, values = tokens + [max_bt], values + [values[-1]]
    return Table([[b, v] for b, v in zip(tokens, values)], dict(key or {}), "floor")


def _numbers(d, name, path, types, bound) -> list:
    """d[name]: a list of `types` (no bools), each at most `bound` in magnitude (NaN refused)."""
    xs = d[name]
    if not isinstance(xs, list) or not all(isinstance(x, types) and not isinstance(x, bool)
                                           for x in xs):
        what = "integers" if types is int else "numbers"
        raise ValueError(f"{path}: field {name!r} must hold {what}, got {reprlib.repr(xs)}")
    if not all(-bound <= x <= bound for x in xs):
        raise ValueError(f"{path}: field {name!r} must hold finite values up to {bound:g}, got "
                         f"{reprlib.repr(xs)}")
    return xs


def _from_own(d: dict, path) -> Table:
    """Our JSON (SPSProfile.to_json), every field checked by name."""
    table, interp, key = d.get("table"), d.get("interp", "linear"), d.get("key") or {}
    pairs = table if isinstance(table, list) and table else None
    if pairs is None or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError(f"{path}: field 'table' must be a non-empty list of [B, rounds_per_s] "
                         f"pairs, got {reprlib.repr(table)}")
    try:
        _numbers({"table": [b for b, _ in pairs]}, "table", path, int, MAX_TOKENS)
        _numbers({"table": [v for _, v in pairs]}, "table", path, (int, float), MAX_RATE)
    except ValueError as e:  # name the column too
        raise ValueError(f"{e} (B must be an int in [1, {MAX_TOKENS}], rounds_per_s a number "
                         f"in (0, {MAX_RATE:g}])") from None
    if not isinstance(interp, str) or interp not in INTERPS:
        raise ValueError(f"{path}: field 'interp' must be one of {INTERPS}, got {interp!r}")
    if not isinstance(key, dict):
        raise ValueError(f"{path}: field 'key' must be an object, got {reprlib.repr(key)}")
    return Table(pairs, key, interp)
