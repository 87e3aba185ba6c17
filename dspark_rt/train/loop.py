"""The training loop shared by target pretraining and drafter training: AdamW with linear warm-up
and cosine decay, gradient clipping, a tqdm bar with the running loss, and resumable state
(model, optimizer, step) saved every `save_every` steps to <out>/train_state.pt.
"""
import math
import os
import time

import torch
from tqdm.auto import tqdm

__all__ = ["make_optimizer", "lr_at", "train_loop", "STATE_FILE", "load_state"]

STATE_FILE = "train_state.pt"


def make_optimizer(named_params, lr: float, weight_decay: float):
    """AdamW; matrices decay, vectors (norm weights, biases) do not."""
    decay, keep = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, steps: int, lr: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to floor * lr at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def load_state(out) -> dict | None:
    path = os.path.join(out, STATE_FILE)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def _save_state(out, step, model, opt, extra):
    tmp = os.path.join(out, STATE_FILE + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict(), **extra}, tmp)
    os.replace(tmp, os.path.join(out, STATE_FILE))  # a kill mid-write keeps the previous state


def train_loop(model, step_fn, *, out, steps: int, lr: float, warmup: int, weight_decay: float,
               save_every: int, export, resume: bool, desc: str, extra_state=None,
               clip: float = 1.0, progress: bool = True) -> dict:
    """Runs step_fn(step) -> (loss tensor, {name: float}) for steps [start, steps).

    export(): writes the loadable checkpoint folder; called at every save and at the end.
    resume: continue from <out>/train_state.pt (model, optimizer, step) when it exists.
    Returns {"start_step", "steps", "seconds", "first_loss", "final_loss", "last": {name: float}}
    where final_loss is the mean loss of the last min(50, steps run) steps."""
    os.makedirs(out, exist_ok=True)
    opt = make_optimizer(model.named_parameters(), lr, weight_decay)
    start = 0
    if resume:
        state = load_state(out)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"]
    params = [p for p in model.parameters() if p.requires_grad]
    bar = tqdm(total=steps, initial=start, desc=desc, unit="step", disable=not progress,
               dynamic_ncols=True)
    recent, last, first, t0 = [], {}, None, time.perf_counter()
    try:
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup)
            loss, parts = step_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            recent = (recent + [loss.item()])[-50:]
            first = recent[0] if first is None else first
            last = {k: float(v) for k, v in parts.items()}  # parts are detached
            bar.update(1)
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}",
                            **{k: f"{v:.3f}" for k, v in last.items()})
            done = step + 1
            if done % save_every == 0 or done == steps:
                _save_state(out, done, model, opt, extra_state or {})
                export()
    finally:
        bar.close()
    if start >= steps:
        export()
    return {"start_step": start, "steps": steps, "seconds": time.perf_counter() - t0,
            "first_loss": first, "last": last,
            "final_loss": sum(recent) / len(recent) if recent else float("nan")}
