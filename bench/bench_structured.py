"""What a grammar costs a speculative round: tau, tokens/s and the host time the grammar walk
takes per round, without a grammar and under a JSON schema and a regex (DESIGN §6).

    python bench/bench_structured.py                 # the shipped pair, 20 humaneval prompts
    python bench/bench_structured.py --limit 8 --json

Greedy, dspark with the fixed policy (every draft verified), prompts cut to --chars characters.
Without a grammar eos is ignored (max_tokens each); a grammar ends its request when it completes,
so outputs are shorter there: compare tau and the per-round costs, not the totals. "grammar ms
/ round" is the host time of the round's grammar steps (draft-1 mask, the verify walk and its
upload), over the rounds that had a grammar; the commit of the emitted tokens is included.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from dspark_rt import Decoder, SamplingParams, SpecMetrics
from dspark_rt.structured import Constraints, StructuredOutputsParams
from dspark_rt.structured.grammar import grammar_book
from dspark_rt.tools.prompts import read_turns

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "dspark_rt" / "pretrained"
EVAL = ROOT.parent / "shared" / "data" / "eval"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "args": {"type": "array", "items": {"type": "string"},
                                                    "maxItems": 4},
                                           "returns": {"type": "string", "maxLength": 24}},
          "required": ["name", "args", "returns"], "additionalProperties": False}
GRAMMARS = {"none": None, "json": StructuredOutputsParams(json=SCHEMA),
            "regex": StructuredOutputsParams(regex=r"    return [a-z_]{1,12}\([a-z_, ]{0,24}\)\n")}


def run(dec, prompts, spec, max_tokens, batch):
    c = dec.engine.state.constraints
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=spec is None,
                            structured_outputs=spec)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += dec.generate(prompts[i:i + batch], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    m = SpecMetrics.merged(o.metrics for o in outs)
    n_tok = sum(len(o.token_ids) for o in outs)
    return {"tau": m.mean_acceptance_length, "tokens": n_tok, "tokens_per_s": n_tok / secs,
            "walks": c.walks, "grammar_ms_per_round": 1e3 * c.host_s / max(c.walks, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=EVAL / "humaneval.jsonl")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--unmasked-drafts", action="store_true",
                    help="draft position 1 unmasked too (lossless either way: what masking it buys)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dec = Decoder.from_pretrained(str(PRETRAINED / "target"), str(PRETRAINED / "dspark"),
                                  mode="dspark", policy="fixed", dtype="float32")
    if a.unmasked_drafts:
        dec.engine.round.draft_keys = lambda runner, grammar, rng: rng
    prompts = [dec.tokenizer.encode(t[0][:a.chars]) for t in read_turns(a.prompts, a.limit)]
    run(dec, prompts[:a.batch], GRAMMARS["json"], 8, a.batch)  # warm-up: compile, first rounds
    rows = {name: run(dec, prompts, spec, a.max_tokens, a.batch) for name, spec in GRAMMARS.items()}
    if a.json:
        print(json.dumps(rows, indent=2))
        return rows
    print(f"shipped pair, float32, dspark fixed, gamma {dec.runner.gamma}, greedy, {len(prompts)} "
          f"prompts of {Path(a.prompts).name}, batch {a.batch}, {torch.get_num_threads()} thread, "
          f"draft position 1 {'unmasked' if a.unmasked_drafts else 'masked'}")
    print(f"{'grammar':8} {'tau':>6} {'tokens':>7} {'tok/s':>8} {'rounds':>7} {'grammar ms/round':>17}")
    for name, r in rows.items():
        print(f"{name:8} {r['tau']:6.3f} {r['tokens']:7d} {r['tokens_per_s']:8.1f} {r['walks']:7d} "
              f"{r['grammar_ms_per_round']:17.3f}")
    return rows


if __name__ == "__main__":
    main()
