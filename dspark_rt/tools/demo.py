"""`dspark-rt demo`: plain decoding against dflash and dspark (every shipped head) on the tiny pair.

dspark_rt/pretrained/ holds a tiny Qwen3 target pretrained on Python standard-library sources,
DSpark drafters with each sequential head (vanilla `dspark`, `dspark_gated`, `dspark_rnn`;
gamma 7, confidence head, calibration table) and a DFlash drafter, trained against it
(scripts/make_tiny_pair.sh rebuilds them). The demo decodes a few code-completion prompts, as
one batch, in every mode, greedily and sampled (T 0.7, a fixed seed), and reports:

* the texts: greedy output must equal plain decoding's token for token (checked); sampled
  output follows the target's distribution but is not token-equal to plain sampling (only
  SamplingParams(coupled=True) makes it so);
* tau (tokens per round) and acceptance by position per mode, greedy and sampled;
* tokens/s and its ratio to plain decoding measured in the same run: the modes are interleaved
  (each mode once per repetition, order reversed every other one) and the best repetition
  counts; the machine, the torch thread count and the 1-minute load average before and after
  are recorded, and the speed is marked not meaningful when the load exceeds 0.75 x cores or
  the repetitions disagree;
* whether the greedy continuations fall into a repetition loop (`repetition_loop`);
* the ECE / AUC of each head's calibrated confidences; plots when matplotlib is installed.

Without the shipped files it stops with an error naming the folder (a random pair's acceptance
would mean nothing).
"""
import json
import os
import textwrap
import time
from pathlib import Path

from .calibrate import round_arrays, served_survival
from ..decoder import Decoder
from ..outputs import SpecMetrics
from ..sampling_params import SamplingParams
from ..policies.sts import _nan_to_none

PRETRAINED = Path(__file__).resolve().parents[1] / "pretrained"
HEADS = ("dspark", "dspark_gated", "dspark_rnn")  # shipped DSpark drafters, one per head type
TEMPERATURE, SEED = 0.7, 1234
LOAD_FRACTION = 0.75  # 1-minute load above this x cores: other work competes for the cores
MAX_SPREAD = 1.3      # best / worst tokens/s of one mode across repetitions above this: noisy
WIDTH = 100           # terminal columns the text output fits

# Short completions in the style of library code; written for the demo (not from any eval set).
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n    result = []\n"
    "    for dirpath, dirnames, filenames in os.walk(root):\n",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n'
    "        self._items = []\n\n    def push(self, item):\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    "    parser.add_argument(",
    "    if not isinstance(name, str):\n        raise TypeError(",
    "def merge_dicts(*dicts):\n    result = {}\n    for d in dicts:\n",
]


def repetition_loop(token_ids, text="", *, window=64, span=24, max_period=8, repeats=3):
    """How a continuation has fallen into a repetition loop within its first `window` tokens, or
    None. text: the decoded `token_ids` (the demo decodes at most `window` tokens). Two signs:

    * tokens: the last `span` or more of the first `window` tokens repeat with a period of at most
      `max_period` tokens (t[i] == t[i - p] along the run): {"kind": "tokens", "period", "span"};
    * lines: a block of 1 to 3 non-blank lines (spaces stripped) repeated `repeats` or more times
      in a row, for loops whose period is longer than `max_period` tokens:
      {"kind": "lines", "period" (lines), "repeats"}.
    """
    ids = list(token_ids)[:window]
    for p in range(1, max_period + 1):
        n = p  # ids[-n:] has period p; grow it to the left while the repeat holds
        while n < len(ids) and ids[-n - 1] == ids[-n - 1 + p]:
            n += 1
        if n >= span and len(ids) >= 2 * p:
            return {"kind": "tokens", "period": p, "span": n}
    lines = [s.strip() for s in text.split("\n") if s.strip()]
    for q in (1, 2, 3):
        for i in range(len(lines) - q * repeats + 1):
            k = 1
            while lines[i + k * q: i + (k + 1) * q] == lines[i: i + q]:
                k += 1
            if k >= repeats:
                return {"kind": "lines", "period": q, "repeats": k}
    return None


def speed_verdict(load_before, load_after, cores, spreads):
    """(meaningful, reason or None) for the tokens/s figures: not meaningful when the 1-minute
    load average, before or after, exceeds LOAD_FRACTION x cores (the demo's own thread adds up
    to about 1 to the reading after), or when a mode's tokens/s varied by more than MAX_SPREAD
    between repetitions. spreads: {label: best / worst tokens/s}."""
    why, limit = [], LOAD_FRACTION * cores
    worst = max(load_before, load_after)
    if worst > limit:
        why.append(f"1-minute load average {worst:.2f} exceeds {LOAD_FRACTION} x {cores} cores "
                   f"= {limit:.2f}: the machine is loaded")
    if spreads:
        label, s = max(spreads.items(), key=lambda kv: kv[1])
        if s > MAX_SPREAD:
            why.append(f"{label} tokens/s varied {s:.2f}x between repetitions")
    return not why, "; ".join(why) or None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machine(device) -> dict:
    import platform

    import torch
    from .env_info import collect
    info = collect()
    cpu = platform.processor() or platform.machine()
    try:  # env_info does not name the CPU model; Linux does
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None
    return {"cpu": cpu, "cores": _cores(), "gpu": gpu, "device": str(device),
            "platform": info["platform"], "python": info["python"], "torch": info["torch"],
            "backends": info["backends"]}


def _shipped():
    """(target, {name: (mode, drafter folder)}) of the shipped pair, or None."""
    def ok(p):
        return all((p / n).is_file() for n in ("config.json", "model.safetensors"))
    heads = {h: ("dspark", PRETRAINED / h) for h in HEADS if ok(PRETRAINED / h)}
    if not (ok(PRETRAINED / "target") and ok(PRETRAINED / "dflash") and heads):
        return None
    return PRETRAINED / "target", {"ar": ("ar", None), "dflash": ("dflash", PRETRAINED / "dflash"), **heads}


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plot_acceptance(modes, path):
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    spec = [m for m, r in modes.items() if r["mode"] != "ar"]
    width = 0.8 / len(spec)
    for j, kind in enumerate(("greedy", "sampled")):
        ax = fig.add_subplot(1, 2, j + 1)
        for i, name in enumerate(spec):
            r = modes[name][kind]
            vals = np.nan_to_num(np.asarray(r["acceptance_by_position"], float), nan=0.0)
            ks = np.arange(1, len(vals) + 1)
            ax.bar(ks + (i - (len(spec) - 1) / 2) * width, vals, width,
                   label=f"{name} (tau {r['mean_acceptance_length']:.2f})")
        # acceptance_by_position: rounds that accepted drafts 1..k over rounds that verified k
        # (unconditional on 1..k-1: it falls with k and sums to about tau - 1)
        ax.set(xlabel="draft position k", ylabel="P(drafts 1..k all accepted | k verified)",
               ylim=(0, 1), xticks=ks,
               title=kind if kind == "greedy" else f"sampled, T {TEMPERATURE}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return str(path)


def _calibration_stats(dec, name, prompts, params, out: Path, plots: dict, can_plot: bool):
    """Pooled / per-position ECE of the calibrated survivals over one extra greedy pass (kept out
    of the timed runs), and the reliability diagram."""
    from .evaluate import calibration_metrics
    from ..policies.sts import reliability_diagram
    dec.round_log = []
    dec.generate(prompts, params, use_tqdm=False)
    conf, ver, acc = round_arrays(dec.round_log)
    dec.round_log = None
    if conf is None or not (ver > 0).any():
        return None
    temps = list(dec.engine.calibration.temperatures[: dec.runner.gamma])
    a = served_survival(dec.engine.calibration, conf)  # the calibration in force (a table too)
    c = calibration_metrics(conf, ver, acc, temps, survival=a)
    if can_plot:
        path = out / f"reliability_{name}.png"
        plots[f"reliability_{name}"] = str(reliability_diagram(conf, acc, ver, temps, path,
                                                               survival=a))
    return {"temperatures": temps, "ece": c["pooled"]["ece"], "auc": c["pooled"]["auc"],
            "ece_by_position": [p["ece"] for p in c["by_position"]]}


def _figures(outs, tps) -> dict:
    """One mode x kind: merged metrics, the best tokens/s, every sample and its loop check."""
    samples = [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                "loop": repetition_loop(o.token_ids, o.text)} for o in outs]
    return {"tokens": sum(len(o.token_ids) for o in outs), "tokens_per_s": max(tps),
            "tokens_per_s_runs": tps, "speed_ratio": None,
            **SpecMetrics.merged(o.metrics for o in outs).as_dict(),
            "loop_share": sum(s["loop"] is not None for s in samples) / len(samples),
            "samples": samples}


def main(out="out/demo", quick=False, as_json=False, device="cpu"):
    import torch
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        # The tiny pair's matmuls are microseconds of work: intra-op threads cost more than they
        # save (on a shared machine 10x more), so the CPU demo runs on one thread.
        torch.set_num_threads(1)
    try:
        return _demo(Path(out), quick, as_json, device)
    finally:
        torch.set_num_threads(threads)


def _demo(out: Path, quick, as_json, device):
    import torch
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    pair = _shipped()
    if pair is None:
        raise FileNotFoundError(f"the shipped model pair is missing from {PRETRAINED} (target, dflash "
                                f"and one of {', '.join(HEADS)}, each with config.json and "
                                "model.safetensors): reinstall dspark_rt, or rebuild the pair with "
                                "scripts/make_tiny_pair.sh")
    target, specs = pair
    prompts = PROMPTS[:3] if quick else PROMPTS
    n_tokens, reps = (32, 2) if quick else (64, 3)
    kinds = {"greedy": SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True),
             "sampled": SamplingParams(temperature=TEMPERATURE, seed=SEED, max_tokens=n_tokens,
                                       ignore_eos=True)}
    say = (lambda *a: None) if as_json else print
    say(f"Model pair: {PRETRAINED}\na 3.7 M-parameter Qwen3 target pretrained on Python stdlib "
        "sources (then trained\nout of greedy repetition loops; still a model this small: "
        "plausible-looking, not working code);\n"
        f"drafters (gamma 7): {', '.join(n for n in specs if n != 'ar')}.")
    say(f"{len(prompts)} prompts as one batch, {n_tokens} new tokens, greedy and sampled (T "
        f"{TEMPERATURE}, seed {SEED});\n{len(specs)} modes interleaved x {reps} repetitions.\n")
    decoders = {name: Decoder.from_pretrained(target, drafter, mode=mode, device=device)
                for name, (mode, drafter) in specs.items()}
    for dec in decoders.values():  # warm-up: first-call allocations stay out of the timings
        dec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    first, tps = {}, {(n, k): [] for n in decoders for k in kinds}
    for rep in range(reps):
        for name in (list(decoders) if rep % 2 == 0 else list(decoders)[::-1]):
            for kind, params in kinds.items():
                t0 = time.perf_counter()
                outs = decoders[name].generate(prompts, params, use_tqdm=False)
                tps[name, kind].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
                first.setdefault((name, kind), outs)
    load_after = os.getloadavg()[0]
    can_plot, plots, modes = _has_matplotlib(), {}, {}
    for name, (mode, drafter) in specs.items():
        r = modes[name] = {"mode": mode, "drafter": None if drafter is None else str(drafter),
                           "calibration_source": decoders[name].calibration_source,
                           **{k: _figures(first[name, k], tps[name, k]) for k in kinds}}
        r["equals_ar"] = [s["token_ids"] for s in r["greedy"]["samples"]] == \
            [s["token_ids"] for s in modes["ar"]["greedy"]["samples"]]
        for k in kinds:
            if mode == "ar":  # plain decoding emits one token per forward (it counts no rounds)
                r[k]["mean_acceptance_length"] = 1.0
            r[k]["speed_ratio"] = r[k]["tokens_per_s"] / modes["ar"][k]["tokens_per_s"]
        r["calibration"] = _calibration_stats(decoders[name], name, prompts, kinds["greedy"], out,
                                              plots, can_plot) if mode == "dspark" else None
    if can_plot:
        plots["acceptance_by_position"] = _plot_acceptance(modes, out / "acceptance_by_position.png")
    spreads = {f"{n} {k}": max(v) / min(v) for (n, k), v in tps.items()}
    meaningful, why = speed_verdict(load_before, load_after, _cores(), spreads)
    summary = {"pair": "shipped", "target": str(target),
               "n_prompts": len(prompts), "max_tokens": n_tokens, "temperature": TEMPERATURE,
               "seed": SEED, "repetitions": reps, "machine": _machine(device),
               "threads": torch.get_num_threads(),
               "load": {"before": load_before, "after": load_after, "cores": _cores(),
                        "limit": LOAD_FRACTION * _cores()},
               "speed_spread": spreads, "speed_meaningful": meaningful, "speed_note": why,
               "loop_share": {n: r["greedy"]["loop_share"] for n, r in modes.items()},
               "modes": modes, "plots": plots}
    text = json.dumps(_nan_to_none(summary), indent=2)
    (out / "results.json").write_text(text + "\n")
    skipped = None if can_plot else "plots skipped: matplotlib is not installed (pip install matplotlib)"
    if as_json:
        if skipped:
            import sys
            print(skipped, file=sys.stderr)
        print(text)
        return summary
    _print_texts(modes)
    _print_table(summary)
    print("\n" + (skipped or textwrap.fill(f"plots in {out}: " + ", ".join(Path(p).name for p in
                                                                       plots.values()), WIDTH))
          + f"\nresults: {out / 'results.json'}")
    if any(k.startswith("reliability_") for k in plots):
        print(textwrap.fill("reliability_*.png: predicted survival against the observed accept "
                            "rate per position; 'before' is the raw confidence (temperature 1), "
                            "'after' the calibration in force (calibration_source in "
                            "results.json).", WIDTH))
    return summary


def _clip(s: str, width: int) -> str:
    s = repr(s)
    return s if len(s) <= width else s[: width - 3] + "..."


def _print_texts(modes):
    """Per prompt: the greedy text (one for all modes when they agree) and each mode's sample."""
    ar = modes["ar"]["greedy"]["samples"]
    for i, s in enumerate(ar):
        last = s["prompt"].rstrip("\n").split("\n")[-1]
        print(f"[{i + 1}] ... {_clip(last, WIDTH - 10)}")
        agree = all(r["greedy"]["samples"][i]["token_ids"] == s["token_ids"] for r in modes.values())
        loop = s["loop"]
        tag = f"{'all modes' if agree else 'ar'}{', LOOPS' if loop else ''}"
        print(f"  greedy ({tag}): {_clip(s['text'], WIDTH - 14 - len(tag))}")
        for name, r in modes.items():
            print(f"  {name:12} T {TEMPERATURE}: {_clip(r['sampled']['samples'][i]['text'], WIDTH - 22)}")


def _print_table(summary):
    modes, m, load = summary["modes"], summary["machine"], summary["load"]
    f2 = lambda x: "  - " if x is None or x != x else f"{x:.2f}"  # noqa: E731
    print(f"\n{'mode':12} {'kind':7} {'tau':>5} {'accept':>6} {'tok/s':>7} {'x ar':>5} {'=ar':>3} "
          f"{'loops':>5}  acceptance by position k=1..gamma")
    for name, r in modes.items():
        for kind in ("greedy", "sampled"):
            f = r[kind]
            acc = "  -" if r["mode"] == "ar" else f"{f['draft_acceptance_rate']:.2f}"
            same = ("yes" if r["equals_ar"] else "NO") if kind == "greedy" else "-"
            loops = f"{round(f['loop_share'] * len(f['samples']))}/{len(f['samples'])}"
            row = (f"{name if kind == 'greedy' else '':12} {kind:7} {f['mean_acceptance_length']:5.2f} "
                   f"{acc:>6} {f['tokens_per_s']:7.0f} {f['speed_ratio']:4.2f}x {same:>3} {loops:>5}  "
                   + " ".join(f2(x) for x in f["acceptance_by_position"]))
            print(row.rstrip())
    n = summary["n_prompts"]
    share = {k: " to ".join(f"{round(x * n)}/{n}" for x in sorted({r[k]["loop_share"] for r in
                                                                    modes.values()}))
             for k in ("greedy", "sampled")}
    print(f"\ntau: tokens per round; x ar: tokens/s over plain decoding's, best of "
          f"{summary['repetitions']} interleaved repetitions;\n=ar: greedy tokens equal plain "
          "decoding's (sampled ones follow the same law, but other draws);\nloops: prompts whose "
          f"continuation repeats itself within {summary['max_tokens']} tokens (repetition_loop): "
          f"greedy {share['greedy']},\nsampled {share['sampled']}.")
    print(f"machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if m['gpu'] else ''}, torch "
          f"{m['torch']} on {summary['threads']} thread(s)\n1-minute load average: "
          f"{load['before']:.2f} before, {load['after']:.2f} after (limit {load['limit']:.2f})")
    if not summary["speed_meaningful"]:
        print(textwrap.fill(f"SPEED RATIOS UNRELIABLE: {summary['speed_note']}.", WIDTH))
    cal = {n: r["calibration"] for n, r in modes.items() if r.get("calibration")}
    if cal:
        print("confidence after calibration (greedy pass): ECE, AUC, ECE by position")
    for name, c in cal.items():
        print(f"  {name:12} {c['ece']:.3f} {c['auc']:.3f}  " + " ".join(f2(x) for x in c["ece_by_position"]))
