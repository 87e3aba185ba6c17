"""Sequential Temperature Scaling: calibrate the confidence head per draft position (DESIGN §4).

Logged rounds give, per round, the raw confidence logits [gamma], how many drafts were verified
(l) and how many of them were accepted (acc). Position k carries the label 1[acc >= k] ("drafts
1..k all survived") and is only observed when k <= l; unobserved positions are masked out.
For k = 1..gamma in order, t_k is the grid point minimising the ECE (equal-width bins) of
a_k = prod_{i<=k} sigmoid(logit_i / t_i) against that label, with t_1..t_{k-1} already fixed.
A positive temperature keeps the ranking of each position's logits.
"""
import json
import math
import reprlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .base import Calibration

FORMAT = "dspark_rt.sts"
# `dspark-rt calibrate` writes here by default; Decoder.from_pretrained uses a file found here
CALIBRATION_FILE = "dspark_calibration.json"
DEFAULT_GRID = np.geomspace(0.05, 20.0, 121)  # ~5 % apart
# SGLang's DSpark STS calibration JSON (see read_sglang_sts): field -> JSON type
SGLANG_STS_FIELDS = {"temperatures": list, "dataset": str, "num_samples": int,
                     "ece_before": list, "ece_after": list}
SUPPORTED = (f'dspark_rt\'s own STS JSON ("format": "{FORMAT}") and SGLang\'s DSpark STS '
             'calibration JSON (an object with "temperatures")')


def ece(p: np.ndarray, y: np.ndarray, n_bins: int = 15) -> float:
    """Expected calibration error: sum over equal-width bins of |mean(p) - mean(y)| * share."""
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    if p.size == 0:
        return float("nan")
    return float(_ece_rows(p[None, :], y, n_bins)[0])


def _ece_rows(P: np.ndarray, y: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of every row of P [G, n] against one label vector y [n] -> [G]."""
    G, n = P.shape
    b = np.minimum((P * n_bins).astype(np.int64), n_bins - 1) + np.arange(G)[:, None] * n_bins
    b = b.ravel()
    cnt = np.bincount(b, minlength=G * n_bins)
    sp = np.bincount(b, weights=P.ravel(), minlength=G * n_bins)
    sy = np.bincount(b, weights=np.broadcast_to(y, P.shape).ravel(), minlength=G * n_bins)
    return (np.abs(sp - sy).reshape(G, n_bins).sum(axis=1)) / n


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC by ranks (Mann-Whitney U), ties get their average rank; NaN with one class only."""
    from scipy.stats import rankdata
    p, y = np.asarray(p, np.float64), np.asarray(y).astype(bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    ranks = rankdata(p)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def brier(p: np.ndarray, y: np.ndarray) -> float:
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def _prepare(conf_logits, accepted, verified):
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2:
        raise ValueError(f"conf_logits must be [n, gamma], got shape {z.shape}")
    n, gamma = z.shape
    acc = np.asarray(accepted, np.int64).reshape(-1)
    ver = np.asarray(verified, np.int64).reshape(-1)
    if acc.shape != (n,) or ver.shape != (n,):
        raise ValueError(f"accepted and verified must be [n={n}], got {acc.shape}, {ver.shape}")
    if (acc < 0).any() or (acc > ver).any() or (ver > gamma).any():
        raise ValueError("need 0 <= accepted <= verified <= gamma for every round")
    k = np.arange(1, gamma + 1)
    labels = acc[:, None] >= k[None, :]        # [n, gamma]
    observed = ver[:, None] >= k[None, :]      # [n, gamma]
    return z, labels, observed


def survivals(conf_logits, temperatures, biases=None) -> np.ndarray:
    """a [n, gamma] = cumprod(sigmoid((logit_k + b_k) / t_k)), float64 (b = 0 without biases)."""
    z = np.asarray(conf_logits, np.float64)
    t = np.asarray(temperatures, np.float64)[: z.shape[1]]
    if biases is not None:
        z = z + np.asarray(biases, np.float64)[: z.shape[1]]
    return np.cumprod(_sigmoid(z / t), axis=1)


def _report(a, labels, observed, n_bins):
    out = []
    for k in range(a.shape[1]):
        m = observed[:, k]
        p, y = a[m, k], labels[m, k]
        rate = float(y.mean()) if m.any() else float("nan")
        out.append({"n": int(m.sum()), "positive_rate": rate,
                    "ece": ece(p, y, n_bins), "auc": auc(p, y), "brier": brier(p, y)})
    return out


def compare(conf_logits, accepted, verified, temperatures, biases=None, n_bins: int = 15, *,
            survival=None):
    """Per position: n, positive_rate and ECE / AUC / Brier of the survival before (raw, t = 1)
    and after calibration (these temperatures and biases, or the given survival [n, gamma]),
    over the rounds that verified the position."""
    z, labels, observed = _prepare(conf_logits, accepted, verified)
    before = _report(survivals(z, [1.0] * z.shape[1]), labels, observed, n_bins)
    after = _report(survivals(z, temperatures, biases) if survival is None else survival,
                    labels, observed, n_bins)
    return [{"position": k + 1, "n": b["n"], "positive_rate": b["positive_rate"],
             **{f"{m}_before": b[m] for m in ("ece", "auc", "brier")},
             **{f"{m}_after": a[m] for m in ("ece", "auc", "brier")}}
            for k, (b, a) in enumerate(zip(before, after))]


@dataclass
class STSResult:
    """temperatures; biases (Platt, online.fit_platt; None: all 0, plain STS); table (a survival
    table, online.fit_table: [gamma][bins] over metadata "logit_range"); report: per position
    before/after ECE, AUC, Brier on the fit rounds; metadata (with "holdout": the same report on
    held-out rounds, when calibrate had some)."""
    temperatures: list[float]
    report: list[dict] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    biases: list[float] | None = None
    table: list | None = None

    def calibration(self) -> Calibration:
        biases = None if self.biases is None else list(self.biases)
        if self.table is None:
            return Calibration(list(self.temperatures), biases)
        from .table import TableCalibration
        return TableCalibration(list(self.temperatures), biases, self.table, *self.logit_range)

    @property
    def logit_range(self) -> tuple[float, float]:
        from .table import HI, LO
        lo, hi = self.metadata.get("logit_range", (LO, HI))
        return float(lo), float(hi)

    def save_sglang(self, path, dataset: str = "") -> Path:
        """Write SGLang's STS calibration JSON (write_sglang_sts) with our per-position ECE.
        SGLang's file holds temperatures only: a fit with non-zero biases is refused."""
        if self.table is not None or (self.biases is not None and any(self.biases)):
            raise ValueError("SGLang's STS JSON holds temperatures only; this calibration has "
                             "biases (Platt): save it with save() instead")
        return write_sglang_sts(path, self.temperatures, dataset=dataset,
                                num_samples=int(self.metadata.get("n_rounds", 0)),
                                ece_before=[r["ece_before"] for r in self.report],
                                ece_after=[r["ece_after"] for r in self.report])

    def save(self, path) -> Path:
        path = Path(path)
        d = {"format": FORMAT, "version": 1, "temperatures": self.temperatures,
             **({} if self.biases is None else {"biases": self.biases}),
             **({} if self.table is None else {"survival_table": self.table}),
             "report": self.report, "metadata": self.metadata}
        # NaN (e.g. AUC with one class) is written as null to stay strict JSON
        path.write_text(json.dumps(_nan_to_none(d), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "STSResult":
        """Our JSON (save), every field checked: errors name the file and the field."""
        d = _read_json(path)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file; read_temperatures also reads SGLang's")
        temps = _finite_list(d.get("temperatures"), path, "temperatures", lo=0.0)
        biases = d.get("biases")  # absent in STS files (version 1 before Platt): all 0
        if biases is not None:
            biases = _finite_list(biases, path, "biases", n=len(temps))
        table = d.get("survival_table")  # [gamma][bins], non-decreasing rows in [0, 1]
        if table is not None:
            rows = table if isinstance(table, list) and len(table) == len(temps) else None
            ok = rows is not None and all(isinstance(r, list) and r and len(r) == len(rows[0])
                                          and all(_is_number(x) and 0 <= x <= 1 for x in r)
                                          and all(a <= b for a, b in zip(r, r[1:])) for r in rows)
            if not ok:
                raise ValueError(f"{path}: field 'survival_table' must be {len(temps)} equally long "
                                 "non-decreasing rows of numbers in [0, 1]")
        report, meta = d.get("report", []), d.get("metadata", {})
        if not isinstance(report, list):
            raise ValueError(f"{path}: field 'report' must be a list, got {reprlib.repr(report)}")
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: field 'metadata' must be an object, got {reprlib.repr(meta)}")
        if "logit_range" in meta:  # the table's bins span it: finite, lo < hi
            r = meta["logit_range"]
            if not (isinstance(r, list) and len(r) == 2 and all(_is_number(x) and math.isfinite(x)
                                                                 for x in r) and r[0] < r[1]):
                raise ValueError(f"{path}: field 'logit_range' (in 'metadata') must be [lo, hi], "
                                 f"finite numbers with lo < hi, got {reprlib.repr(r)}")
        return cls(temps, report, meta, biases, table)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and \
        -sys.float_info.max <= x <= sys.float_info.max  # NaN fails both sides


def _finite_list(v, path, name, *, n=None, lo=None) -> list[float]:
    """v as a non-empty list of finite floats (n of them; each > lo), else an error naming the
    file and field."""
    ok = isinstance(v, list) and v and (n is None or len(v) == n) and \
        all(_is_number(x) and (lo is None or x > lo) for x in v)
    if not ok:
        what = f"{n} " if n is not None else "a non-empty list of "
        more = f" > {lo:g}" if lo is not None else ""
        raise ValueError(f"{path}: field '{name}' must be {what}finite numbers{more}, got "
                         f"{reprlib.repr(v)}")
    return [float(x) for x in v]


def _nan_to_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def fit_sts(conf_logits, accepted, verified, *, grid=None, n_bins: int = 15,
            metadata: dict | None = None) -> STSResult:
    """Fit t_1..t_gamma left to right (see module docstring).

    conf_logits [n, gamma] raw confidence logits; accepted [n] drafts accepted; verified [n]
    drafts verified (l). A position with no observed round keeps t = 1.
    Returns STSResult; .calibration() is the policy.Calibration to run with.
    """
    z, labels, observed = _prepare(conf_logits, accepted, verified)
    grid = DEFAULT_GRID if grid is None else np.asarray(grid, np.float64)
    n, gamma = z.shape
    temps = []
    prefix = np.ones(n)  # prod_{i<k} sigmoid(z_i / t_i) with the fitted t_i
    for k in range(gamma):
        m = observed[:, k]
        if m.any():
            pre, zk, yk = prefix[m], z[m, k], labels[m, k].astype(np.float64)
            step = max(1, 2**24 // len(zk))  # grid points per chunk: bounds the [G, n_k] block
            errs = np.concatenate([
                _ece_rows(pre[None, :] * _sigmoid(zk[None, :] / g[:, None]), yk, n_bins)
                for g in np.split(grid, range(step, len(grid), step))])
            t = float(grid[int(np.argmin(errs))])
        else:
            t = 1.0
        temps.append(t)
        prefix = prefix * _sigmoid(z[:, k] / t)
    report = compare(z, accepted, verified, temps, n_bins=n_bins)
    meta = {"n_rounds": n, "gamma": gamma, "n_bins": n_bins,
            "grid": [float(grid[0]), float(grid[-1]), len(grid)], **(metadata or {})}
    return STSResult(temps, report, meta)


def read_temperatures(path) -> Calibration:
    """Per-position temperatures (and Platt biases) from our JSON (STSResult.save) or SGLang's
    (read_sglang_sts, temperatures only).
    Any other file is refused with an error naming the supported formats."""
    d = _read_json(path)
    if isinstance(d, dict) and d.get("format") == FORMAT:
        return STSResult.load(path).calibration()
    return Calibration(read_sglang_sts(path)["temperatures"])


def read_sglang_sts(path) -> dict:
    """SGLang's DSpark STS calibration, the file behind `--speculative-dspark-confidence-sts-path`.

    Source: sgl-project/sglang, python/sglang/srt/speculative/dspark_components/dspark_sts.py,
    class `DSparkStsCalibration` (written by sglang/benchmark/dspark_sts_fit.py, loaded by
    `load_sts_calibration_from_path` into the confidence head's temperatures by the DSpark
    verify planner). One JSON object:

    * `temperatures` [float], required, non-empty, every value > 0: t_k for draft position k
      (index 0 is the first draft after the anchor); the head's survival is
      cumprod_k sigmoid(logit_k / t_k), as in our Calibration. SGLang requires exactly gamma of
      them; our Calibration needs at least gamma and uses the first gamma.
    * `dataset` str: what it was fitted on (the fitter writes its input glob); optional.
    * `num_samples` int: logged rounds it was fitted on; optional.
    * `ece_before`, `ece_after` [float]: per position, the ECE (15 equal-width bins) of the
      cumulative survival against "drafts 1..k accepted" with t = 1 and with the fitted t;
      optional. The encoder leaves out fields at their defaults ("", 0, []).

    Other fields are ignored, as SGLang's decoder does. Returns the five fields, defaults filled.
    """
    d = _read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{path}: top level is a {type(d).__name__}, expected an object; "
                         f"supported: {SUPPORTED}")
    if "temperatures" not in d:
        raise ValueError(f"{path}: no field 'temperatures' (found {sorted(d)}); "
                         f"supported: {SUPPORTED}")
    out = {"temperatures": [], "dataset": "", "num_samples": 0, "ece_before": [], "ece_after": []}
    for name, typ in SGLANG_STS_FIELDS.items():
        if name not in d:
            continue
        v = d[name]
        numbers = typ is list and all(isinstance(x, float) or _is_number(x)
                                      for x in (v if isinstance(v, list) else []))
        if not isinstance(v, typ) or isinstance(v, bool) or (typ is list and not numbers):
            what = "a list of numbers" if typ is list else f"a JSON {typ.__name__}"
            raise ValueError(f"{path}: field {name!r} must be {what}, got {reprlib.repr(v)}")
        out[name] = [float(x) for x in v] if typ is list else v
    temps = out["temperatures"]
    if not temps or not all(math.isfinite(t) and t > 0 for t in temps):
        raise ValueError(f"{path}: field 'temperatures' must be non-empty, finite and > 0, "
                         f"got {temps}")
    return out


def write_sglang_sts(path, temperatures, *, dataset: str = "", num_samples: int = 0,
                     ece_before=(), ece_after=()) -> Path:
    """Write SGLang's DSpark STS calibration JSON (fields as in read_sglang_sts). Like SGLang's
    encoder, fields at their defaults are left out; so is an ECE list with a NaN (a position
    never verified), since SGLang's decoder takes no null there and the lists are optional."""
    temps = [float(t) for t in temperatures]
    if not temps or not all(math.isfinite(t) and t > 0 for t in temps):
        raise ValueError(f"temperatures must be non-empty, finite and > 0, got {temps}")
    eces = {k: [float(e) for e in v] for k, v in (("ece_before", ece_before),
                                                  ("ece_after", ece_after))}
    d = {"temperatures": temps, "dataset": str(dataset), "num_samples": int(num_samples),
         **{k: v for k, v in eces.items() if all(math.isfinite(e) for e in v)}}
    d = {k: v for k, v in d.items() if k == "temperatures" or v not in ("", 0, [])}
    path = Path(path)
    path.write_text(json.dumps(d) + "\n")
    return path


def _read_json(path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e}); supported: {SUPPORTED}") from None
    except RecursionError:
        raise ValueError(f"{path}: not readable JSON (nested deeper than the interpreter's "
                         f"recursion limit); supported: {SUPPORTED}") from None


def reliability_diagram(conf_logits, accepted, verified, temperatures, path, *,
                        n_bins: int = 15, biases=None, survival=None) -> Path:
    """One PNG with a panel per position: mean a_k against the accept rate per bin, before
    (t = 1) and after calibration, with the diagonal. Uses the Agg canvas directly, so no global
    matplotlib backend is switched. survival [n, gamma]: the calibrated survivals, when not
    given by temperatures and biases (a survival table)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    z, labels, observed = _prepare(conf_logits, accepted, verified)
    gamma = z.shape[1]
    curves = {"before": survivals(z, [1.0] * gamma),
              "after": survivals(z, temperatures, biases) if survival is None else survival}
    cols = min(gamma, 4)
    rows = -(-gamma // cols)
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows))
    FigureCanvasAgg(fig)
    edges = np.linspace(0, 1, n_bins + 1)
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.plot([0, 1], [0, 1], color="0.6", lw=0.8)
        m = observed[:, k]
        for name, a in curves.items():
            p, y = a[m, k], labels[m, k]
            b = np.clip(np.digitize(p, edges) - 1, 0, n_bins - 1)
            cnt = np.bincount(b, minlength=n_bins)
            ok = cnt > 0
            mp = np.bincount(b, p, n_bins)[ok] / cnt[ok]
            my = np.bincount(b, y.astype(np.float64), n_bins)[ok] / cnt[ok]
            ax.plot(mp, my, marker="o", ms=3, label=f"{name} ECE {ece(p, y, n_bins):.3f}")
        ax.set(title=f"position {k + 1} (n={int(m.sum())})", xlim=(0, 1), ylim=(0, 1),
               xlabel="predicted survival a_k", ylabel="observed")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=80)
    return path
