"""`dspark-rt demo`: ar vs dflash vs dspark on the tiny model pair that ships with the package.

dspark_rt/pretrained/ holds a tiny Qwen3 target pretrained on Python standard-library sources,
a DSpark drafter (sequential Markov head + confidence head, gamma 7) and a DFlash drafter with the
same backbone size, trained against it (scripts/make_tiny_pair.sh rebuilds them). The demo
decodes a few built-in code-completion prompts greedily in each mode, checks that every mode emits
exactly the target's tokens, and reports tau (tokens per round), tokens/s, the speed-up over
plain decoding, acceptance by position and, when a calibration file ships, the ECE of the
confidence head; plots go to the out folder. Without the shipped files it falls back to a tiny
randomly initialised pair (the whole path runs, the acceptance numbers then mean nothing).
"""
import json
import time
from pathlib import Path

from .. import testing
from .calibrate import round_arrays
from ..decoder import Decoder
from ..outputs import SpecMetrics
from ..sampling_params import SamplingParams
from ..policies.sts import CALIBRATION_FILE, _nan_to_none

PRETRAINED = Path(__file__).resolve().parents[1] / "pretrained"
MODES = ("ar", "dflash", "dspark")

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


def _shipped():
    """(target, dspark, dflash, calibration or None) of the shipped pair, or None."""
    t, s, f = PRETRAINED / "target", PRETRAINED / "dspark", PRETRAINED / "dflash"
    files = [p / name for p in (t, s, f) for name in ("config.json", "model.safetensors")]
    if not all(p.is_file() for p in files):
        return None
    cal = s / CALIBRATION_FILE
    return t, s, f, (cal if cal.is_file() else None)


def _random_pair(out: Path):
    target, drafter = out / "tiny-target", out / "tiny-dspark"
    if not (target / "config.json").exists():
        testing.write_tiny_target(target, seed=1, vocab=512, hidden=128, layers=4, heads=4,
                                  kv_heads=2, head_dim=32)
    if not (drafter / "config.json").exists():
        testing.write_tiny_drafter(drafter, target, head="vanilla", layers=2, block_size=7,
                                   target_layer_ids=[0, 2], markov_rank=32, confidence=True,
                                   confidence_markov=True, seed=7, share_target_layers=True)
    return target, drafter, drafter, None


def _plot_acceptance(results, path):
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    modes = [m for m in MODES if m != "ar"]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = np.nan_to_num(np.asarray(results[mode]["acceptance_by_position"], float), nan=0.0)
        ks = np.arange(1, len(vals) + 1)
        ax.bar(ks + (i - (len(modes) - 1) / 2) * width, vals, width,
               label=f"{mode} (tau {results[mode]['mean_acceptance_length']:.2f})")
    ax.set(xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)", ylim=(0, 1),
           xticks=ks, title="conditional acceptance by position (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return str(path)


def _run_mode(mode, target, drafter, calibration, prompts, params, device, progress):
    dec = Decoder.from_pretrained(target, None if mode == "ar" else drafter, mode=mode,
                                  device=device,
                                  calibration=calibration if mode == "dspark" else None)
    dec.round_log = [] if mode == "dspark" else None
    t0 = time.perf_counter()
    outs = dec.generate(prompts, params, use_tqdm=progress)
    secs = time.perf_counter() - t0
    m = SpecMetrics.merged(o.metrics for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    r = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs, **m.as_dict(),
         "samples": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids} for o in outs]}
    return r, dec


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _calibration_stats(dec, out: Path, plots: dict, can_plot: bool = True):
    """Pooled / per-position ECE of the calibrated survivals, and the reliability diagram."""
    from .evaluate import calibration_metrics
    from ..policies.sts import reliability_diagram
    conf, ver, acc = round_arrays(dec.round_log)
    if conf is None or not (ver > 0).any():
        return None
    temps = list(dec.engine.calibration.temperatures[: dec.runner.gamma])
    c = calibration_metrics(conf, ver, acc, temps)
    if can_plot:
        plots["reliability"] = str(reliability_diagram(conf, acc, ver, temps, out / "reliability.png"))
    return {"temperatures": temps, "ece": c["pooled"]["ece"], "auc": c["pooled"]["auc"],
            "ece_by_position": [p["ece"] for p in c["by_position"]]}


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
    out.mkdir(parents=True, exist_ok=True)
    pair = _shipped()
    trained = pair is not None
    target, dspark, dflash, calibration = pair if trained else _random_pair(out)
    prompts = PROMPTS[:3] if quick else PROMPTS
    params = SamplingParams(temperature=0, max_tokens=32 if quick else 64, ignore_eos=True)
    if not as_json:
        if trained:
            print(f"Tiny pair shipped in {PRETRAINED}: a 3.7 M-parameter Qwen3 target "
                  "pretrained on Python stdlib sources (its greedy text loops; what matters\n"
                  "here is agreement with the drafters), DSpark and DFlash drafters (gamma 7).")
        else:
            print(f"NOTE: the shipped model pair is missing from {PRETRAINED}; running a tiny "
                  f"RANDOMLY INITIALISED pair written to {out} instead.\nAcceptance on random "
                  "weights says nothing about real models.")
        print(f"{len(prompts)} prompts, greedy, {params.max_tokens} new tokens each.\n")
    results, decoders, reference = {}, {}, None
    for mode in MODES:
        r, dec = _run_mode(mode, target, dflash if mode == "dflash" else dspark, calibration,
                           prompts, params, device, progress=not as_json)
        ids = [s["token_ids"] for s in r["samples"]]
        r["equals_ar"] = reference is None or ids == reference
        reference = reference or ids
        results[mode], decoders[mode] = r, dec
    can_plot = _has_matplotlib()
    plots = {"acceptance_by_position":
             _plot_acceptance(results, out / "acceptance_by_position.png")} if can_plot else {}
    ar_tps = results["ar"]["tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / ar_tps
    results["dspark"]["calibration"] = _calibration_stats(decoders["dspark"], out, plots, can_plot) \
        if calibration is not None else None
    summary = {"pair": "shipped" if trained else "random", "target": str(target),
               "dspark": str(dspark), "dflash": str(dflash),
               "calibration": None if calibration is None else str(calibration),
               "max_tokens": params.max_tokens, "n_prompts": len(prompts), "modes": results,
               "plots": plots}
    text = json.dumps(_nan_to_none(summary), indent=2)
    (out / "results.json").write_text(text + "\n")
    if as_json:
        print(text)
        return summary
    _print_table(results)
    print("\nplots: " + (", ".join(plots.values()) if plots else "none (matplotlib is not installed)")
          + f"\nresults: {out / 'results.json'}")
    return summary


def _print_table(results):
    # the most varied completion: a 3.7 M-parameter target loops a lot under greedy decoding
    s = max(results["dspark"]["samples"], key=lambda x: len(set(x["token_ids"])))
    print(f"\nprompt {s['prompt']!r}\n  -> {s['text']!r}\n")
    f2 = lambda x: "  - " if x != x else f"{x:.2f}"
    print(f"{'mode':7} {'tau':>5} {'tok/s':>7} {'speedup':>7} {'accept':>6}  {'= ar':5} "
          "acceptance by position k=1..gamma")
    for mode, r in results.items():
        by_pos = " ".join(f2(x) for x in r["acceptance_by_position"])
        tau = f"{r['mean_acceptance_length']:.2f}" if mode != "ar" else "1.00"
        print(f"{mode:7} {tau:>5} {r['tokens_per_s']:7.1f} {r['speedup']:6.2f}x "
              f"{r['draft_acceptance_rate']:6.2f}  {str(r['equals_ar']):5} {by_pos}")
    c = results["dspark"].get("calibration")
    if c:
        temps = " ".join(f"{t:.2g}" for t in c["temperatures"])
        print(f"\ndspark confidence after STS (temperatures {temps}): ECE {c['ece']:.3f}, "
              f"AUC {c['auc']:.3f}\n  ECE by position: "
              + " ".join(f2(x) for x in c["ece_by_position"]))
