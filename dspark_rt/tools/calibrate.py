"""`dspark-rt calibrate`: fit the calibration of a drafter's confidence head on real decoding.

Decodes a prompt file in dspark mode with the `fixed` policy, so every round verifies every
draft (up to the request's remaining budget) and every verified position gets a label, logs
(raw confidence logits, verified length, accepted count) per request-round, fits one of
METHODS, and writes the JSON (default `<drafter>/dspark_calibration.json`), a reliability
diagram next to it (when matplotlib is installed) and a per-position before/after table on stdout. With a held-out split (the
last `holdout` share of the prompts, or a second prompt file) the fit is also scored on rounds
it never saw: a second table, and metadata["holdout"] in the JSON.
"""
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..decoder import Decoder
from .prompts import fit_length, load_prompts, read_turns
from ..sampling_params import SamplingParams
from ..policies.online import fit_platt, fit_table
from ..policies.sts import CALIBRATION_FILE, STSResult, compare, fit_sts, reliability_diagram

DEFAULT_NAME = CALIBRATION_FILE
# sts: a temperature per position (the paper's; SGLang reads it); platt: temperature and bias;
# table: a monotone survival table per position (policies/online.py), what the online
# recalibration fits
METHODS = {"sts": fit_sts, "platt": fit_platt, "table": fit_table}


def plotting_available() -> bool:
    """Whether matplotlib (the optional `plot` extra) imports; prints a note when it does not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install 'dspark_rt[plot]'): no plots written")
        return False
    return True


def decode_logged(decoder, prompts, params, *, batch_size: int = 8, progress: bool = True,
                  desc: str = "decode"):
    """generate() over prompts in batches with the round log on.
    Returns (outputs, round_log, seconds of decoding)."""
    decoder.round_log = []
    outs, seconds = [], 0.0
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    try:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            t0 = time.perf_counter()
            outs += decoder.generate(batch, params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            bar.update(len(batch))
        return outs, decoder.round_log, seconds
    finally:
        bar.close()
        decoder.round_log = None


def round_arrays(round_log):
    """Per request-round arrays from Decoder.round_log: conf_logits [n, gamma] float64 (None when
    no round carried confidences), verified [n] and accepted [n] int64."""
    drafted = [e for e in round_log if e["conf_logit"] is not None]
    if drafted:  # rounds that drafted nothing (no request could verify a draft) carry no labels
        round_log = drafted
    ver = np.array([v for e in round_log for v in e["lengths"]], np.int64)
    acc = np.array([a for e in round_log for a in e["accepted"]], np.int64)
    if not drafted:
        return None, ver, acc
    return np.concatenate([e["conf_logit"].double().numpy() for e in drafted]), ver, acc


def prompts_for(decoder, prompts_file, *, max_tokens: int, limit=None, chat=False,
                max_chars: int | None = None):
    """Token-id prompts that fit the target's context with max_tokens new tokens (text prompts
    when the target has no tokenizer; those must fit by themselves). max_chars: keep the first
    max_chars characters of each prompt's first turn (not with chat)."""
    if max_chars is None:
        return load_prompts(prompts_file, decoder.tokenizer, chat=chat, limit=limit,
                            max_prompt_tokens=fit_length(decoder, max_tokens))
    if chat:
        raise ValueError("max_chars cuts the raw first turn; it does not apply with chat")
    texts = [t[0][:max_chars] for t in read_turns(prompts_file, limit)]
    if decoder.tokenizer is None:
        return texts
    room = fit_length(decoder, max_tokens)
    return [ids[len(ids) - room:] if len(ids) > room else ids
            for ids in map(decoder.tokenizer.encode, texts)]


def served_survival(calibration, conf) -> np.ndarray:
    """The survivals a [n, gamma] float64 a policy sees under `calibration` (its apply)."""
    return calibration.apply(torch.as_tensor(conf, dtype=torch.float64))[1].double().numpy()


def split_prompts(prompts, holdout: float):
    """(fit, held-out): the last round(holdout * n) prompts are held out (at least one each)."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must lie in [0, 1), got {holdout}")
    n_ho = int(round(holdout * len(prompts)))
    if holdout and not 1 <= n_ho < len(prompts):
        raise ValueError(f"holdout {holdout} of {len(prompts)} prompts leaves an empty split")
    return prompts[:len(prompts) - n_ho], prompts[len(prompts) - n_ho:]


def format_report(report: list[dict]) -> str:
    fmt = lambda x: "   -  " if x is None or x != x else f"{x:6.3f}"
    lines = [f"{'pos':>3} {'n':>7} {'accept':>6} | {'ECE before':>10} {'after':>6} | "
             f"{'AUC before':>10} {'after':>6} | {'Brier before':>12} {'after':>6}"]
    for r in report:
        lines.append(f"{r['position']:>3} {r['n']:>7} {fmt(r['positive_rate'])} | "
                     f"{fmt(r['ece_before']):>10} {fmt(r['ece_after'])} | "
                     f"{fmt(r['auc_before']):>10} {fmt(r['auc_after'])} | "
                     f"{fmt(r['brier_before']):>12} {fmt(r['brier_after'])}")
    return "\n".join(lines)


def calibrate(target, drafter, prompts_file, out=None, *, max_tokens: int = 128,
              limit: int | None = None, temperature: float = 0.0, batch_size: int = 8,
              chat: bool = False, device="cpu", dtype=None, progress: bool = True,
              method: str = "table", holdout: float = 0.0, holdout_prompts=None,
              max_chars: int | None = None) -> STSResult:
    """Fit and save the calibration of `drafter` (a DSpark folder with a confidence head).

    method: a key of METHODS. holdout: share of the prompts (the last ones) kept out of the fit
    and scored; holdout_prompts: a prompt file scored instead (its first `limit` prompts).
    max_chars: cut each prompt's first turn to this many characters.
    out: the JSON path (default <drafter>/dspark_calibration.json); the reliability diagram goes
    to <out stem>_reliability.png beside it. Returns the STSResult (temperatures, per-position
    report, metadata with "holdout") and prints the before/after tables."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    if holdout and holdout_prompts is not None:
        raise ValueError("give a holdout share or a holdout prompt file, not both")
    read_turns(prompts_file, limit)  # a bad prompt file fails before any model is loaded
    if holdout_prompts is not None:
        read_turns(holdout_prompts, limit)
    dec = Decoder.from_pretrained(target, drafter, mode="dspark", policy="fixed", device=device,
                                  dtype=dtype)
    if dec.drafter.conf_w is None:
        raise ValueError(f"{drafter}: the drafter has no confidence head "
                         "(enable_confidence_head), there is nothing to calibrate")
    load = lambda f: prompts_for(dec, f, max_tokens=max_tokens, limit=limit, chat=chat,
                                 max_chars=max_chars)
    prompts, held = split_prompts(load(prompts_file), holdout)
    if holdout_prompts is not None:
        held = load(holdout_prompts)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    outs, log, seconds = decode_logged(dec, prompts, params, batch_size=batch_size,
                                       progress=progress, desc="calibrate")
    conf, ver, acc = round_arrays(log)
    if conf is None or len(ver) == 0 or not (ver > 0).any():
        raise ValueError(f"{prompts_file}: decoding produced no verified drafts to calibrate on "
                         "(raise --max-tokens or use more prompts)")
    emitted = sum(len(o.token_ids) for o in outs)
    meta = {"target": str(target), "drafter": str(drafter), "prompts": str(prompts_file),
            "n_prompts": len(prompts), "max_tokens": max_tokens, "temperature": temperature,
            "chat": chat, "dtype": str(dec.target.dtype).removeprefix("torch."),
            "tokens": emitted, "seconds": seconds,
            "mean_acceptance_length": float((acc + 1).mean()), "max_chars": max_chars}
    result = METHODS[method](conf, acc, ver, metadata=meta)
    result.metadata["method"] = method
    cal = result.calibration()
    if held:
        _, hlog, _ = decode_logged(dec, held, params, batch_size=batch_size, progress=progress,
                                   desc="held-out")
        hconf, hver, hacc = round_arrays(hlog)
        result.metadata["holdout"] = {
            "prompts": str(holdout_prompts or prompts_file), "n_prompts": len(held),
            "share": holdout, "n_rounds": len(hver),
            "report": compare(hconf, hacc, hver, None, survival=served_survival(cal, hconf))}
    out = Path(out) if out is not None else Path(drafter) / DEFAULT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    result.save(out)
    png = None
    if plotting_available():
        png = reliability_diagram(conf, acc, ver, result.temperatures,
                                  out.with_name(out.stem + "_reliability.png"),
                                  survival=served_survival(cal, conf))
    print(f"{method} calibration of {drafter} on {len(prompts)} prompts of {prompts_file}: "
          f"{len(ver)} request-rounds, gamma {conf.shape[1]}, tau {meta['mean_acceptance_length']:.3f}")
    print(describe(cal))
    print("fit split:\n" + format_report(result.report))
    if held:
        h = result.metadata["holdout"]
        print(f"held-out split ({h['n_prompts']} prompts of {h['prompts']}, {h['n_rounds']} "
              f"request-rounds, never fitted on):\n" + format_report(h["report"]))
    print(f"wrote {out}" + (f"\nwrote {png}" if png is not None else ""))
    return result


def describe(cal) -> str:
    """One line naming the calibration's parameters."""
    f = lambda xs: " ".join(f"{x:.3g}" for x in xs)
    if getattr(cal, "table", None) is not None:
        return f"survival table: {len(cal.table)} positions x {len(cal.table[0])} bins"
    return "temperatures: " + f(cal.temperatures) + (
        "" if cal.biases is None else "; biases: " + f(cal.biases))


def main(argv=None) -> int:
    from .prompts import existing_file, parse_tool_args, positive, run_tool, tool_parser
    ap = tool_parser("calibrate", "Fit the calibration of a drafter's confidence head on real "
                     "decoding of a prompt file (dspark mode, fixed policy).")
    ap.add_argument("--out", help=f"JSON path (default <drafter>/{DEFAULT_NAME})")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    ap.add_argument("--method", default="table", choices=sorted(METHODS),
                    help="sts: temperature per position; platt: temperature and bias; table: "
                    "monotone survival table per position")
    ap.add_argument("--holdout", type=positive(float, zero_ok=True), default=0.0,
                    help="share of the prompts (the last ones) held out of the fit and scored")
    ap.add_argument("--holdout-prompts", type=existing_file,
                    help="a prompt file to score the fit on instead (same --limit)")
    ap.add_argument("--max-prompt-chars", type=positive(int),
                    help="cut each prompt's first turn to this many characters")
    a = parse_tool_args(ap, argv)
    return run_tool(ap, calibrate, a.target, a.drafter, a.prompts, a.out, max_tokens=a.max_tokens,
                    limit=a.limit, temperature=a.temperature, batch_size=a.batch_size,
                    chat=a.chat, device=a.device, dtype=a.dtype, method=a.method,
                    holdout=a.holdout, holdout_prompts=a.holdout_prompts,
                    max_chars=a.max_prompt_chars)
