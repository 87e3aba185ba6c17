"""`dspark-rt calibrate`: fit STS temperatures of a drafter's confidence head on real decoding.

Decodes a prompt file in dspark mode with the `fixed` policy, so every round verifies every
draft (up to the request's remaining budget) and every verified position gets a label, logs
(raw confidence logits, verified length, accepted count) per request-round, fits
`sts.fit_sts`, and writes the JSON (default `<drafter>/dspark_calibration.json`), a
reliability diagram next to it and a per-position before/after table on stdout.
"""
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..decoder import Decoder
from .prompts import fit_length, load_prompts, read_turns
from ..sampling_params import SamplingParams
from ..policies.sts import CALIBRATION_FILE, STSResult, fit_sts, reliability_diagram

DEFAULT_NAME = CALIBRATION_FILE


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


def prompts_for(decoder, prompts_file, *, max_tokens: int, limit=None, chat=False):
    """Token-id prompts that fit the target's context with max_tokens new tokens (text prompts
    when the target has no tokenizer; those must fit by themselves)."""
    return load_prompts(prompts_file, decoder.tokenizer, chat=chat, limit=limit,
                        max_prompt_tokens=fit_length(decoder, max_tokens))


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
              chat: bool = False, device="cpu", dtype=None, progress: bool = True) -> STSResult:
    """Fit and save STS temperatures for `drafter` (a DSpark folder with a confidence head).

    out: the JSON path (default <drafter>/dspark_calibration.json); the reliability diagram goes
    to <out stem>_reliability.png beside it. Returns the STSResult (temperatures, per-position
    report, metadata) and prints the before/after table."""
    read_turns(prompts_file, limit)  # a bad prompt file fails before any model is loaded
    dec = Decoder.from_pretrained(target, drafter, mode="dspark", policy="fixed", device=device,
                                  dtype=dtype)
    if dec.drafter.conf_w is None:
        raise ValueError(f"{drafter}: the drafter has no confidence head "
                         "(enable_confidence_head), there is nothing to calibrate")
    prompts = prompts_for(dec, prompts_file, max_tokens=max_tokens, limit=limit, chat=chat)
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
            "mean_acceptance_length": float((acc + 1).mean())}
    result = fit_sts(conf, acc, ver, metadata=meta)
    out = Path(out) if out is not None else Path(drafter) / DEFAULT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    result.save(out)
    png = reliability_diagram(conf, acc, ver, result.temperatures,
                              out.with_name(out.stem + "_reliability.png"))
    print(f"STS calibration of {drafter} on {len(prompts)} prompts of {prompts_file}: "
          f"{len(ver)} request-rounds, gamma {conf.shape[1]}, tau {meta['mean_acceptance_length']:.3f}")
    print("temperatures: " + " ".join(f"{t:.3g}" for t in result.temperatures))
    print(format_report(result.report))
    print(f"wrote {out}\nwrote {png}")
    return result


def main(argv=None) -> int:
    from .prompts import parse_tool_args, run_tool, tool_parser
    ap = tool_parser("calibrate", "Fit STS temperatures of a drafter's confidence head on real "
                     "decoding of a prompt file (dspark mode, fixed policy).")
    ap.add_argument("--out", help=f"JSON path (default <drafter>/{DEFAULT_NAME})")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    a = parse_tool_args(ap, argv)
    return run_tool(ap, calibrate, a.target, a.drafter, a.prompts, a.out, max_tokens=a.max_tokens,
                    limit=a.limit, temperature=a.temperature, batch_size=a.batch_size,
                    chat=a.chat, device=a.device, dtype=a.dtype)
