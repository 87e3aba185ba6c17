"""A survival table: the calibration online.py fits (offline in fit_table, online in
OnlineCalibration); see there for the model and why."""
from dataclasses import dataclass, field

import numpy as np
import torch

from .base import Calibration, no_nan_rows

LO, HI, NB = -16.0, 16.0, 64  # bins of the survival logit L_k (0.5 wide)


def survival_logit(z: np.ndarray) -> np.ndarray:
    """L [n, gamma] = logit(prod_{i<=k} sigmoid(z_i)), float64, without overflow."""
    ls = np.cumsum(-np.logaddexp(0.0, -np.asarray(z, np.float64)), axis=1)  # log s_k <= 0
    return ls - np.log(-np.expm1(np.minimum(ls, -1e-300)))


def _bins(L, lo, hi, nb):
    L = np.where(np.isnan(L), -np.inf, L)  # a NaN confidence counts as confidence 0
    return np.clip(np.floor((L - lo) * (nb / (hi - lo))), 0, nb - 1).astype(np.int64)


@dataclass
class TableCalibration(Calibration):
    """A survival table (module docstring): table [gamma][nb] of non-decreasing values in [0, 1]
    over L in [lo, hi]; temperatures / biases are kept for what reads them (reports) and are not
    used while a table is set."""
    table: list | None = field(default=None, repr=False)
    lo: float = LO
    hi: float = HI

    def survival(self, z: np.ndarray) -> np.ndarray:
        """a [n, gamma] float64 on the host (the same map as apply)."""
        if self.table is None:
            return self.apply(torch.as_tensor(z, dtype=torch.float64))[1].double().numpy()
        tab = np.asarray(self.table, np.float64)
        g = z.shape[1]
        idx = _bins(survival_logit(z), self.lo, self.hi, tab.shape[1])
        return np.minimum.accumulate(tab[np.arange(g)[None, :], idx], axis=1)

    def apply(self, conf_logit: torch.Tensor):
        if self.table is None:
            return super().apply(conf_logit)
        gamma = conf_logit.shape[1]
        if len(self.table) < gamma:
            raise ValueError(f"calibration table has {len(self.table)} positions, need {gamma}")
        tab = self._device_table(conf_logit.device)[:gamma]                 # [gamma, nb]
        z = conf_logit.to(torch.float64)
        z = z.masked_fill(torch.isnan(z), -torch.inf)  # NaN: confidence 0 (no bad bin index)
        ls = torch.cumsum(torch.nn.functional.logsigmoid(z), 1)
        L = ls - torch.log(-torch.expm1(ls.clamp(max=-1e-300)))               # [R, gamma]
        idx = ((L - self.lo) * (tab.shape[1] / (self.hi - self.lo))).floor()
        idx = idx.clamp(0, tab.shape[1] - 1).long()
        a = torch.cummin(tab.gather(1, idx.T).T, 1).values                   # [R, gamma]
        prev = torch.cat([torch.ones_like(a[:, :1]), a[:, :-1]], 1)
        c_hat = a / prev.clamp(min=1e-300)  # a <= prev: 0 where prev is 0
        return no_nan_rows(conf_logit, c_hat.float(), a.float())

    def _device_table(self, device):
        c = getattr(self, "_cache", None)  # holds the list it was made from: no id reuse
        if c is None or c[0] is not self.table or c[1] != device:
            c = self._cache = (self.table, device,
                               torch.tensor(self.table, dtype=torch.float64).to(device))
        return c[2]

    def __getstate__(self):  # no device tensors travel to tensor-parallel ranks
        d = dict(self.__dict__)
        d.pop("_cache", None)
        return d
