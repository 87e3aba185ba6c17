"""`dspark-rt eval`: decode a prompt file and report what the speculative rounds achieved.

Printed and written to <out_dir>/summary.json:
* tau: mean tokens emitted per request-round, the target's own token included;
* conditional acceptance by position: P(draft k accepted | verified, drafts 1..k-1 accepted);
* mean verify length: drafts sent to the target per request-round;
* tokens/s: emitted tokens over decoding wall time (model loading and profiling excluded);
* ECE / AUC / Brier of the confidences a policy sees (calibrated survival a_k) against the
  realised label "drafts 1..k accepted", per position over the rounds that verified position k,
  and pooled over all of them. Under sync/async/threshold only verified positions are labelled,
  so these numbers describe the positions the policy chose to verify. The survivals scored are
  those the rounds were served with: under --online-calibration, each round's in force then.
* which calibration was in force (its file, "given", "+ online") and its parameters.
With --warmup N the first N prompts are decoded first and not measured (they warm the online
calibration up; without it they are skipped), so `--limit 80 --warmup 40` measures prompts 41-80.
Plots: acceptance_by_position.png and reliability.png (before: raw head, after: calibrated),
written after summary.json, and skipped with a note when matplotlib (the `plot` extra) is missing.
"""
import json
import math
from pathlib import Path

import numpy as np

from .calibrate import (decode_logged, describe, plotting_available, prompts_for, round_arrays,
                        served_survival)
from ..decoder import Decoder
from ..outputs import SpecMetrics
from .prompts import existing_file, read_turns
from ..sampling_params import SamplingParams
from ..policies import POLICIES
from ..policies.sts import _nan_to_none, auc, brier, ece, reliability_diagram, survivals


def calibration_metrics(conf, verified, accepted, temperatures, n_bins: int = 15, *,
                        survival=None) -> dict:
    """Per-position and pooled ECE / AUC / Brier of survivals a_k = prod sigmoid(logit_i / t_i)
    (or the given survival [n, gamma]) against 1[accepted >= k], over rounds with verified >= k."""
    a = survivals(conf, temperatures) if survival is None else survival
    k = np.arange(1, conf.shape[1] + 1)[None, :]
    labels, observed = accepted[:, None] >= k, verified[:, None] >= k
    per = []
    for j in range(conf.shape[1]):
        m = observed[:, j]
        p, y = a[m, j], labels[m, j]
        per.append({"position": j + 1, "n": int(m.sum()), "ece": ece(p, y, n_bins),
                    "auc": auc(p, y), "brier": brier(p, y)})
    p, y = a[observed], labels[observed]
    return {"pooled": {"n": int(observed.sum()), "ece": ece(p, y, n_bins), "auc": auc(p, y),
                       "brier": brier(p, y)}, "by_position": per}


def plot_acceptance(by_position: list[float], path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ks = np.arange(1, len(by_position) + 1)
    vals = np.nan_to_num(np.asarray(by_position, np.float64), nan=0.0)
    ax.bar(ks, vals, color="tab:blue")
    ax.set(xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)", ylim=(0, 1),
           xticks=ks, title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return Path(path)


def evaluate(target, drafter, prompts_file, *, mode=None, policy: str = "fixed",
             threshold: float = 0.5, calibration=None, sps=None, out_dir="out/eval",
             max_tokens: int = 128, limit: int | None = None, temperature: float = 0.0,
             batch_size: int = 8, chat: bool = False, device="cpu", dtype=None,
             progress: bool = True, tensor_parallel_size: int = 1,
             online_calibration: bool = False, warmup: int = 0,
             max_chars: int | None = None) -> dict:
    """Decode prompts_file with (target, drafter) and write summary.json + plots to out_dir.

    mode / policy / threshold / calibration / sps as in Decoder (a policy's profiles not given
    are measured or read from this machine's cache); online_calibration: as in Decoder; warmup: prompts decoded first, not measured; max_chars: cut each first turn.
    Returns the summary dict."""
    read_turns(prompts_file, limit)  # a bad prompt file fails before any model is loaded
    dec = Decoder.from_pretrained(target, drafter, mode=mode, policy="fixed", device=device,
                                  dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    if policy != "fixed" or calibration is not None or online_calibration:  # reuse the weights
        kw = {"threshold": threshold} if policy == "threshold" else {}
        source = (dec.calibration_source if calibration is None else str(calibration)
                  if isinstance(calibration, (str, Path)) else "given")
        loaded = dec
        try:  # the policy comes from the registry: its profiles are measured or given (sps)
            dec = Decoder(dec.target, dec.drafter, dec.tokenizer, mode=dec.mode, policy=policy,
                          sps=sps, calibration=calibration if calibration is not None
                          else dec.calibration, device=dec.device,
                          tensor_parallel=dec.tensor_parallel,
                          online_calibration=online_calibration, **kw)
        except BaseException:
            loaded.shutdown()
            raise
        if source and dec.calibration_source:
            dec.calibration_source = dec.calibration_source.replace("given", source)
    prompts = prompts_for(dec, prompts_file, max_tokens=max_tokens, limit=limit, chat=chat,
                          max_chars=max_chars)
    if warmup >= len(prompts):
        raise ValueError(f"warmup {warmup} leaves none of the {len(prompts)} prompts to measure")
    warm, prompts = prompts[:warmup], prompts[warmup:]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    online = getattr(dec.calibration, "record", False) is not False  # an OnlineCalibration
    if warm and online:
        decode_logged(dec, warm, params, batch_size=batch_size, progress=progress, desc="warm-up")
        dec.calibration.flush()
    if online:
        dec.calibration.record = []  # the survivals the measured rounds are served with
    outs, log, seconds = decode_logged(dec, prompts, params, batch_size=batch_size,
                                       progress=progress, desc=f"eval {dec.mode}/{policy}")
    gamma = dec.runner.gamma
    m = SpecMetrics.merged(o.metrics for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    summary = {"target": str(target), "drafter": str(drafter), "prompts": str(prompts_file),
               "mode": dec.mode, "policy": policy if dec.mode == "dspark" else "fixed",
               "calibration": dec.calibration_source,  # the temperatures below came from here
               "temperatures": list(dec.engine.calibration.temperatures[:gamma]),
               "calibration_params": describe(dec.engine.calibration),
               "warmup_prompts": len(warm) if online else 0,
               "dtype": str(dec.target.dtype).removeprefix("torch."), "device": str(dec.device),
               "n_prompts": len(prompts), "max_tokens": max_tokens, "temperature": temperature,
               "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "tau": m.mean_acceptance_length,
               "mean_verify_length": m.num_draft_tokens / m.num_rounds if m.num_rounds else 0.0,
               **m.as_dict(), "confidence": None}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conf, ver, acc = round_arrays(log)
    labelled = conf is not None and len(ver) and (ver > 0).any()
    if labelled:
        temps = summary["temperatures"]
        if online:  # a round without a verified draft carries no label and is not recorded
            dec.calibration.flush()
            rec = dec.calibration.record
            a, ver, acc = (np.concatenate([r[i] for r in rec]) for i in range(3))
            conf = np.concatenate([e["conf_logit"].double().numpy() for e in log
                                   if any(e["lengths"])])
        else:
            a = served_survival(dec.engine.calibration, conf)
        summary["confidence"] = calibration_metrics(conf, ver, acc, temps, survival=a)
    summary["plots"] = {}
    path = out_dir / "summary.json"
    write = lambda: path.write_text(json.dumps(_nan_to_none(summary), indent=1) + "\n")
    write()  # the results first: a plot that fails loses none of them
    print(format_summary(summary))
    print(f"wrote {path}")
    if not plotting_available():
        return summary
    plots = summary["plots"]
    if gamma:
        plots["acceptance_by_position"] = str(plot_acceptance(
            m.acceptance_by_position, out_dir / "acceptance_by_position.png",
            f"{dec.mode}/{summary['policy']}: tau {summary['tau']:.2f}"))
    if labelled:
        plots["reliability"] = str(reliability_diagram(
            conf, acc, ver, summary["temperatures"], out_dir / "reliability.png", survival=a))
    write()
    print("".join(f"wrote {p}\n" for p in plots.values()), end="")
    return summary


def format_summary(s: dict) -> str:
    f3 = lambda x: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"
    lines = [f"{s['mode']}/{s['policy']} on {s['n_prompts']} prompts of {s['prompts']} "
             f"({s['dtype']}, {s['device']})",
             f"tau (tokens per request-round, bonus included): {s['tau']:.3f}",
             f"mean verify length per request-round: {s['mean_verify_length']:.3f} of "
             f"gamma {s['gamma']}",
             f"tokens/s: {s['tokens_per_s']:.1f} ({s['tokens']} tokens in {s['seconds']:.2f} s)",
             "acceptance by position: " + " ".join(f3(x) for x in s["acceptance_by_position"])]
    c = s["confidence"]
    if c is None:
        lines.append("confidence: none (no confidence head, or not dspark mode)")
    else:
        p = c["pooled"]
        lines.append(f"calibration: {s['calibration']} ({s['calibration_params']})")
        lines.append(f"confidence (temperatures {' '.join(f'{t:.3g}' for t in s['temperatures'])}):"
                     f" pooled ECE {f3(p['ece'])} AUC {f3(p['auc'])} Brier {f3(p['brier'])} "
                     f"over {p['n']} verified positions")
        lines.append("  by position ECE: " + " ".join(f3(r["ece"]) for r in c["by_position"]))
        lines.append("  by position AUC: " + " ".join(f3(r["auc"]) for r in c["by_position"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    from .prompts import parse_tool_args, positive, run_tool, tool_parser
    ap = tool_parser("eval", "Decode a prompt file; report tau, acceptance by position, verify "
                     "lengths, tokens/s and confidence calibration; write summary.json + plots.")
    ap.add_argument("--mode", choices=["ar", "dflash", "dspark"],
                    help="default: dspark when the drafter has a head or confidence, else dflash")
    ap.add_argument("--policy", default="fixed", choices=sorted(POLICIES))
    ap.add_argument("--threshold", type=float, default=0.5, help="for --policy threshold")
    ap.add_argument("--calibration", type=existing_file, help="STS JSON (ours or SGLang's)")
    ap.add_argument("--sps", type=existing_file, help="SPS profile JSON for sync/async/auto (default: the "
                    "cached profile of this machine, measured now if there is none)")
    ap.add_argument("--out", default="out/eval", help="folder for summary.json and the plots")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks to shard the models over (this process and N - 1 workers)")
    ap.add_argument("--online-calibration", action="store_true",
                    help="refit the calibration from the rounds served (OnlineCalibration)")
    ap.add_argument("--warmup", type=positive(int, zero_ok=True), default=0,
                    help="the first N prompts are decoded first and not measured")
    ap.add_argument("--max-prompt-chars", type=positive(int),
                    help="cut each prompt's first turn to this many characters")
    a = parse_tool_args(ap, argv)
    return run_tool(ap, evaluate, a.target, a.drafter, a.prompts, mode=a.mode, policy=a.policy,
                    threshold=a.threshold, calibration=a.calibration, sps=a.sps, out_dir=a.out,
                    max_tokens=a.max_tokens, limit=a.limit, temperature=a.temperature,
                    batch_size=a.batch_size, chat=a.chat, device=a.device, dtype=a.dtype,
                    tensor_parallel_size=a.tensor_parallel_size,
                    online_calibration=a.online_calibration, warmup=a.warmup,
                    max_chars=a.max_prompt_chars)
