"""`make demo`: ar vs dflash vs dspark on a model pair, with the speculative statistics.

Until a trained pair ships with the package, the demo writes a tiny RANDOMLY INITIALISED pair
(target + DSpark drafter whose layers copy the target's first layers) in the real on-disk formats,
loads it back through the public API and decodes a few prompts in each mode. Acceptance numbers
from random weights say nothing about real models; the point is that the whole path runs and that
every mode emits exactly the target's greedy tokens.
"""
import json
import time
from pathlib import Path

from . import testing
from .decoder import Decoder
from .sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\nfor name in", "class Stack:\n    def push(self,",
           "return sorted(items, key="]


def _pair(out: Path):
    target, drafter = out / "tiny-target", out / "tiny-dspark"
    if not (target / "config.json").exists():
        testing.write_tiny_target(target, seed=1, vocab=512, hidden=128, layers=4, heads=4,
                                  kv_heads=2, head_dim=32)
    if not (drafter / "config.json").exists():
        testing.write_tiny_drafter(drafter, target, head="vanilla", layers=2, block_size=7,
                                   target_layer_ids=[0, 2], markov_rank=32, confidence=True,
                                   confidence_markov=True, seed=7, share_target_layers=True)
    return target, drafter


def main(out="out/demo", quick=False, as_json=False, device="cpu"):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target, drafter = _pair(out)
    prompts = PROMPTS[:2] if quick else PROMPTS
    params = SamplingParams(temperature=0, max_tokens=16 if quick else 48, ignore_eos=True)
    if not as_json:
        print("NOTE: no trained model pair ships yet: this demo runs a tiny randomly initialised\n"
              f"target and DSpark drafter written to {out} in the Hugging Face / DeepSpec formats.\n"
              "Acceptance on random weights says nothing about real models.\n")
    results, reference = {}, None
    for mode in ("ar", "dflash", "dspark"):
        dec = Decoder.from_pretrained(target, None if mode == "ar" else drafter, mode=mode, device=device)
        t0 = time.perf_counter()
        outs = dec.generate(prompts, params, use_tqdm=not as_json)
        secs = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        m = outs[0].metrics.__class__(outs[0].metrics.gamma)
        for o in outs:
            m.merge(o.metrics)
        same = reference is None or [o.token_ids for o in outs] == reference
        reference = reference or [o.token_ids for o in outs]
        results[mode] = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                         "equals_ar": same, **m.as_dict(),
                         "samples": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids}
                                     for o in outs]}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if as_json:
        print(json.dumps(results, indent=2))
        return results
    for o in results["dspark"]["samples"][:2]:
        print(f"prompt {o['prompt']!r}\n  -> {o['text']!r}\n  ids {o['token_ids']}")
    ar_tps = results["ar"]["tokens_per_s"]
    print(f"\n{'mode':8} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'accept':>7}  equals ar  acceptance by position")
    for mode, r in results.items():
        by_pos = " ".join("-" if x != x else f"{x:.2f}" for x in r["acceptance_by_position"])
        print(f"{mode:8} {r['tokens_per_s']:8.1f} {r['tokens_per_s'] / ar_tps:7.2f}x "
              f"{r['mean_acceptance_length']:6.2f} {r['draft_acceptance_rate']:7.2f}  "
              f"{str(r['equals_ar']):9}  {by_pos}")
    print(f"\nresults: {out / 'results.json'}")
    return results
