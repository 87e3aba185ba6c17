"""Calibrations that learn from rounds: a survival table (fitted offline by fit_table, kept up to
date online by OnlineCalibration from the rounds the engine serves), and per-position Platt
scaling (fit_platt).

Survival table. The head's raw survival s_k = prod_{i<=k} sigmoid(z_i) is mapped, per position,
by a non-decreasing step function of its logit L_k = logit(s_k) (NB equal bins on [LO, HI]):
a_k = table_k[bin(L_k)], then a = cummin_k(a) so that survival never grows along the chain, and
c_hat_k = a_k / a_{k-1}. The table is the isotonic regression, per position, of the label
1[drafts 1..k accepted] on the bins, over the request-rounds that verified position k, with
`prior` pseudo-labels per bin at the raw head's value sigmoid(bin centre). It keeps the ranking
of s_k within a position. A temperature cannot do this: under greedy decoding a chain that
survives its first drafts usually survives all of them (looping text), far above a product of
per-position sigmoids; the table follows whatever shape survival has.

Online, every verified draft is a free label: the statistics are per position and bin counts
and accepted counts, decayed with a half-life in rounds; every refit_every rounds the table is
refitted. Lossless for the reason the async budget is (DESIGN §4): a round's lengths come from a
table fitted on earlier rounds only, never on its own draft tokens.

Platt. c_hat_k = sigmoid(w_k z_k + beta_k), the probability that draft k is accepted given drafts
1..k-1 were (labels on the rounds that verified k with 1..k-1 accepted), fitted by Newton's
method on the log loss; in Calibration's form sigmoid((z + b) / t): t = 1 / w, b = beta / w.
"""
import numpy as np
import torch

from .base import Calibration, int_arg
from .table import HI, LO, NB, TableCalibration, _bins, survival_logit

W_MIN, W_MAX = 0.02, 50.0                           # Platt: t in [0.02, 50], w > 0 keeps ranking


def conditional_labels(z, verified, accepted):
    """(observed, label), both bool [n, gamma]: position k is observed when it was verified with
    drafts 1..k-1 accepted; its label is 'draft k accepted'."""
    k = np.arange(1, z.shape[1] + 1)[None, :]
    acc, ver = np.asarray(accepted)[:, None], np.asarray(verified)[:, None]
    return (acc >= k - 1) & (ver >= k), acc >= k


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def newton_platt(x, n, pos, w0, beta0, *, prior: float = 1.0, steps: int = 25):
    """Per row g of x [G, M] (logits), n [G, M] (label counts), pos [G, M] (accepted counts):
    (w [G], beta [G]) minimising the log loss of sigmoid(w x + beta) plus
    prior / 2 * ((w - w0)^2 + (beta - beta0)^2). A row without labels returns (w0, beta0)."""
    x, n, pos = (np.asarray(a, np.float64) for a in (x, n, pos))
    w0, beta0 = np.asarray(w0, np.float64), np.asarray(beta0, np.float64)
    w, beta = w0.copy(), beta0.copy()
    for _ in range(steps):
        p = _sigmoid(w[:, None] * x + beta[:, None])
        r, h = n * p - pos, n * p * (1.0 - p)            # residual, curvature per bin
        gw = (r * x).sum(1) + prior * (w - w0)
        gb = r.sum(1) + prior * (beta - beta0)
        hww, hwb, hbb = (h * x * x).sum(1) + prior, (h * x).sum(1), h.sum(1) + prior
        det = hww * hbb - hwb * hwb
        dw, db = (hbb * gw - hwb * gb) / det, (hww * gb - hwb * gw) / det
        scale = np.minimum(1.0, 2.0 / np.maximum(np.abs(dw) * 4.0, np.abs(db)).clip(1e-12))
        w = np.clip(w - scale * dw, W_MIN, W_MAX)        # damped: at most 0.5 in w, 2 in beta
        beta = beta - scale * db
    return w, beta


def fit_platt(conf_logits, accepted, verified, *, prior: float = 1.0, n_bins: int = 15,
              metadata: dict | None = None):
    """Per-position Platt scaling of logged rounds (arguments as sts.fit_sts), starting from and
    pulled towards the raw head (t = 1, b = 0) by `prior` pseudo-labels. Returns an
    sts.STSResult with biases; its report compares raw and calibrated survivals."""
    from . import sts
    z, _, _ = sts._prepare(conf_logits, accepted, verified)
    observed, label = conditional_labels(z, verified, accepted)
    g = z.shape[1]
    w, beta = newton_platt(z.T, observed.T, (observed & label).T, np.ones(g), np.zeros(g),
                           prior=prior)
    t, b = [float(x) for x in 1.0 / w], [float(x) for x in beta / w]
    meta = {"method": "platt", "n_rounds": len(z), "gamma": g, "n_bins": n_bins,
            "prior": prior, **(metadata or {})}
    return sts.STSResult(t, sts.compare(z, accepted, verified, t, b, n_bins), meta, b)


class _SurvivalStats:
    """Per position and bin of L_k: decayed counts of rounds that verified k, and of those whose
    drafts 1..k were all accepted."""

    def __init__(self, gamma: int, lo=LO, hi=HI, nb=NB):
        self.lo, self.hi, self.nb = lo, hi, nb
        self.n, self.pos = np.zeros((gamma, nb)), np.zeros((gamma, nb))

    def add(self, z, verified, accepted, keep: float = 1.0):
        g = z.shape[1]
        k = np.arange(1, g + 1)[None, :]
        observed, label = verified[:, None] >= k, accepted[:, None] >= k
        idx = np.arange(g)[None, :] * self.nb + _bins(survival_logit(z), self.lo, self.hi, self.nb)
        self.n *= keep
        self.pos *= keep
        self.n[:g] += np.bincount(idx[observed], minlength=g * self.nb).reshape(g, self.nb)
        self.pos[:g] += np.bincount(idx[observed & label], minlength=g * self.nb).reshape(g, self.nb)

    def table(self, prior: float) -> list:
        """Isotonic regression per position of the bin rates, prior pseudo-labels per bin at the
        raw head's value."""
        centres = self.lo + (np.arange(self.nb) + 0.5) * (self.hi - self.lo) / self.nb
        raw = _sigmoid(centres)
        w = self.n + prior
        y = (self.pos + prior * raw) / w
        return [_pav(y[j], w[j]) for j in range(len(y))]


def _pav(y: np.ndarray, w: np.ndarray) -> list[float]:
    """Weighted least-squares non-decreasing fit of y (pool adjacent violators), clipped to
    [0, 1]; ~40 us for 64 bins."""
    vals, wts, cnt = [], [], []
    for v, ww in zip(y.tolist(), w.tolist()):
        c = 1
        while vals and vals[-1] > v:  # pool with the block before until the order holds
            pv, pw = vals.pop(), wts.pop()
            v, ww, c = (pv * pw + v * ww) / (pw + ww), ww + pw, c + cnt.pop()
        vals.append(v)
        wts.append(ww)
        cnt.append(c)
    return [min(1.0, max(0.0, v)) for v, c in zip(vals, cnt) for _ in range(c)]


def fit_table(conf_logits, accepted, verified, *, prior: float = 1.0, n_bins: int = 15,
              metadata: dict | None = None):
    """Survival table of logged rounds (arguments as sts.fit_sts). Returns an sts.STSResult with
    .table (and the STS temperatures of the same rounds); its report compares raw and
    table-calibrated survivals."""
    from . import sts
    z, _, _ = sts._prepare(conf_logits, accepted, verified)
    stats = _SurvivalStats(z.shape[1])
    stats.add(z, np.asarray(verified, np.int64), np.asarray(accepted, np.int64))
    g = z.shape[1]
    # temperatures: the STS fit of the same rounds, for what reads temperatures only (SGLang,
    # the `sts_temperatures` of a drafter config); the table does not use them
    temps = sts.fit_sts(z, accepted, verified, n_bins=n_bins).temperatures
    cal = TableCalibration(temps, None, stats.table(prior))
    meta = {"method": "table", "n_rounds": len(z), "gamma": g, "n_bins": n_bins,
            "prior": prior, "logit_range": [LO, HI], **(metadata or {})}
    report = sts.compare(z, accepted, verified, None, n_bins=n_bins, survival=cal.survival(z))
    return sts.STSResult(cal.temperatures, report, meta, table=cal.table)


class OnlineCalibration(TableCalibration):
    """A survival table refitted from the rounds it observes (module docstring).

    base: the calibration in force until position 1 has min_labels labels; refit_every: rounds
    between refits (the confidences of a device tensor are read then, one read for all of
    them); half_life: rounds after which a label counts half; prior: pseudo-labels per bin at
    the raw head's value; record: keep, per refit, (survival in force [n, gamma], verified [n],
    accepted [n]) of the rounds seen, to measure the calibration they were served with."""

    def __init__(self, base: Calibration | None, gamma: int, *, refit_every: int = 32,
                 half_life: float = 512.0, prior: float = 1.0, min_labels: int = 64,
                 record: bool = False):
        gamma, refit_every = int_arg("gamma", gamma, 1), int_arg("refit_every", refit_every, 1)
        min_labels = int_arg("min_labels", min_labels, 0)
        base = base or Calibration.identity(gamma)
        if len(base.temperatures) < gamma:
            raise ValueError(f"calibration has {len(base.temperatures)} temperatures, need {gamma}")
        super().__init__(list(base.temperatures[:gamma]),
                         None if base.biases is None else list(base.biases[:gamma]),
                         getattr(base, "table", None))
        self.base = base
        self.gamma, self.refit_every, self.half_life = gamma, refit_every, half_life
        self.prior, self.min_labels = prior, min_labels
        self.stats = _SurvivalStats(gamma)
        self.pending: list = []  # rounds since the last refit: (conf, lengths, accepted)
        self.rounds = self.refits = 0
        self.record = [] if record else None

    def observe(self, conf_logit, lengths, num_accepted) -> None:
        if conf_logit is None or not any(lengths):
            return  # no draft verified: no label
        if conf_logit.device.type == "cpu":
            conf_logit = conf_logit.detach().to(torch.float64).numpy().copy()
        else:  # kept on the device (its buffer may be reused next round) until the refit
            conf_logit = conf_logit.detach().clone()
        self.pending.append((conf_logit, lengths, num_accepted))
        if len(self.pending) >= self.refit_every:
            self.flush()

    def flush(self) -> None:
        """Folds the pending rounds into the statistics and refits the table."""
        if not self.pending:
            return
        dev = [c for c, _, _ in self.pending if isinstance(c, torch.Tensor)]
        stacked = torch.cat(dev).double().cpu().numpy() if dev else None  # the one device read
        zs, cut = [], 0
        for c, _, _ in self.pending:
            if isinstance(c, torch.Tensor):
                zs.append(stacked[cut:cut + len(c)])
                cut += len(c)
            else:
                zs.append(c)
        z = np.concatenate(zs)[:, :self.gamma]
        ver = np.fromiter((v for _, ls, _ in self.pending for v in ls), np.int64, len(z))
        acc = np.fromiter((a for _, _, As in self.pending for a in As), np.int64, len(z))
        rounds, self.pending = len(self.pending), []
        if self.record is not None:  # the survivals these rounds were served with
            self.record.append((self.survival(z), ver, acc))
        self.stats.add(z, ver, acc, keep=0.5 ** (rounds / self.half_life))
        if self.stats.n[0].sum() >= self.min_labels:
            self.table = self.stats.table(self.prior)
        self.rounds += rounds
        self.refits += 1

    def __getstate__(self):
        d = super().__getstate__()
        d["pending"], d["record"] = [], None
        return d
