"""End-to-end decoding: ar vs dflash vs dspark (fixed / sync / async) against batch size.

Per mode and batch size: tokens/s, per-user tokens/s, tau (tokens per round, bonus included),
mean verify length, device-to-host reads per round, and the per-round time split of the Round's
steps (draft: block forward, LM head and sequential head; scheduling; verify forward;
acceptance; drafter context update; the rest = engine scheduling, commit and bookkeeping;
dspark_rt.testing.phases). JSON with --json; a plot of throughput against
per-user speed with --plot.

Models: --model shipped (the tiny trained pair, real acceptance; the CPU default) or a
random-weight pair of real shapes (--model qwen3-8b on a GPU; --model tiny checks the path on a
CPU), which needs --accept-prob: BENCHMARK-ONLY synthetic acceptance (dspark_rt.testing.synthetic), one
conditional acceptance probability per draft position (a single value is used for all).

    python bench/bench_e2e.py [--batch 1 4 16] [--max-tokens 48] [--json out.json] [--plot out.png]
    python bench/bench_e2e.py --device cuda --model qwen3-8b --accept-prob 0.8 --batch 1 8 32 128
"""
import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.testing import phases as phase_timer, synthetic
from dspark_rt.testing.bench import header as device_header

PAIR = Path(__file__).resolve().parents[1] / "dspark_rt" / "pretrained"
PROMPTS = ["def merge_sort(xs):\n", "import json\n\ndef load(path):\n", "class Queue:\n    def __init__(self):\n",
           "for i in range(10):\n", "def parse_args(argv):\n", "with open(path) as f:\n",
           "try:\n    import numpy\n", "def fib(n):\n    if n < 2:\n"]
MODES = [("ar", "fixed"), ("dflash", "fixed"), ("dspark", "fixed"), ("dspark", "sync"), ("dspark", "async"),
         ("dspark", "auto")]
PHASES = ("draft", "schedule", "verify_forward", "accept", "context_update", "other")


class Models:
    """The model pair of a run, built once and shared by every mode."""

    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        self.random = args.model != "shipped"
        self._pair, self._sps = None, None
        if self.random:
            from dspark_rt.testing.random_models import random_pair
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
            self._pair = random_pair(args.model, dtype=dtype, device=self.device)

    def prompts(self, batch):
        if not self.random:
            return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        g = torch.Generator().manual_seed(batch)
        V = self._pair[0].config.vocab_size
        return [torch.randint(0, V - 2, (self.args.prompt_len,), generator=g).tolist() for _ in range(batch)]

    def decoder(self, mode, policy):
        if not self.random:
            drafter = None if mode == "ar" else PAIR / ("dflash" if mode == "dflash" else "dspark")
            cal = (PAIR / "dspark" / "dspark_calibration.json") if mode == "dspark" else None
            kw = {"sps": self._profile(policy)} if policy in ("sync", "async", "auto") else {}
            return Decoder.from_pretrained(PAIR / "target", drafter, mode=mode, policy=policy,
                                           device=self.device, calibration=cal, **kw)
        target, drafter = self._pair
        kw = {}
        if policy in ("sync", "async", "auto"):
            kw["sps"] = self._profile(policy)
        dec = Decoder(target, None if mode == "ar" else drafter, None, mode=mode, policy=policy,
                      device=self.device, **kw)
        if mode != "ar":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                synthetic.install(dec, self.accept_prob(drafter.gamma))
        return dec

    def accept_prob(self, gamma):
        p = self.args.accept_prob
        return p * gamma if len(p) == 1 else p

    def _profile(self, policy):
        """One SPS(B) for sync, async and auto (a round's cost does not depend on acceptance),
        covering the largest batch of the run, measured or the cached one for this machine;
        auto also gets the profiles of plain rounds and of rounds that verify no draft."""
        if self._sps is None:
            from dspark_rt.runner import Runner
            from dspark_rt.runner.profiling import load_or_profile_jointly
            if self.random:
                target, drafter = self._pair
            else:
                probe = Decoder.from_pretrained(PAIR / "target", PAIR / "dspark", device=self.device)
                target, drafter = probe.target, probe.drafter
            kw = dict(seconds=self.args.profile_seconds, max_batch=max(self.args.batch),
                      context_len=self.args.prompt_len if self.random else None, progress=False)
            spec = Runner(target, drafter, "dspark", 16, self.device)
            plain = Runner(target, None, "ar", 16, self.device)  # measured together, interleaved
            self._sps = tuple(load_or_profile_jointly([(spec, "spread"), (plain, "spread"),
                                                       (spec, "no_drafts")], **kw))
        return self._sps if policy == "auto" else self._sps[0]


def _generate(dec, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return dec.generate(prompts, params, use_tqdm=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_cuda_syncs(dec, prompts, max_tokens) -> float | None:
    """Synchronising CUDA calls per round, counted by PyTorch's sync debug mode over a whole
    generate call (prefill and engine bookkeeping included)."""
    if dec.device.type != "cuda":
        return None
    e = dec.engine
    rounds0 = e.num_rounds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _generate(dec, prompts, max_tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = e.num_rounds - rounds0
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    return syncs / n if n else None


def run(models, mode, policy, batch, max_tokens):
    dec = models.decoder(mode, policy)
    prompts = models.prompts(batch)
    # warm-up: the same run once, so that kernels load and every CUDA graph bucket the timed
    # run replays is captured before the clock starts
    _generate(dec, prompts, max_tokens)
    r, e = dec.runner, dec.engine
    on_gpu = models.device.type == "cuda"
    # The phase split costs a device sync per phase on a GPU: there it gets a separate, shorter
    # pass; on the CPU timing the phases costs nothing and the timed run records them.
    times = {} if on_gpu else phase_timer.install(dec)
    _sync(models.device)
    reads0, rounds0 = e.round_host_reads, e.num_rounds
    t0 = time.perf_counter()
    outs = _generate(dec, prompts, max_tokens)
    _sync(models.device)
    secs = split_secs = time.perf_counter() - t0
    rounds = e.num_rounds - rounds0
    reads = (e.round_host_reads - reads0) / rounds if rounds else 0.0
    if on_gpu:
        times = phase_timer.install(dec)
        t1 = time.perf_counter()
        _generate(dec, prompts, max(8, max_tokens // 4))
        _sync(models.device)
        split_secs = time.perf_counter() - t1
    phase_timer.uninstall(dec)
    phases = dict(times)
    phases["other"] = max(0.0, split_secs - sum(phases.values()))
    syncs = count_cuda_syncs(dec, prompts[: min(batch, 4)], 16)
    tokens = sum(len(o.token_ids) for o in outs)
    m = [o.metrics for o in outs]
    n_rounds = sum(x.num_rounds for x in m)
    row = {"mode": mode, "policy": policy, "batch": batch, "tokens": tokens, "seconds": secs,
           "tokens_per_s": tokens / secs, "per_user_tokens_per_s": tokens / secs / batch,
           "tau": (sum(x.num_accepted_tokens for x in m) + n_rounds) / n_rounds if n_rounds else 1.0,
           "mean_verify_length": sum(x.num_draft_tokens for x in m) / n_rounds if n_rounds else 0.0,
           "rounds": rounds, "host_reads_per_round": reads, "cuda_syncs_per_round": syncs,
           "phase_share": {k: v / split_secs for k, v in phases.items()}}
    if models.random and mode != "ar":
        row["synthetic_accept_prob"] = models.accept_prob(dec.runner.gamma)
    if r.graphs is not None:
        row["cuda_graphs"] = dict(r.graphs.stats)
    del dec, outs
    gc.collect()
    if models.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, policy in MODES:
        pts = [r for r in rows if r["mode"] == mode and r["policy"] == policy]
        if not pts:
            continue
        ax.plot([r["per_user_tokens_per_s"] for r in pts], [r["tokens_per_s"] for r in pts], "o-",
                label=f"{mode}/{policy}")
        for r in pts:
            ax.annotate(str(r["batch"]), (r["per_user_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("total tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="shipped", choices=["shipped", "qwen3-8b", "tiny"],
                    help="shipped: the trained tiny pair; qwen3-8b / tiny: random weights of "
                         "those shapes with synthetic acceptance (needs --accept-prob)")
    ap.add_argument("--accept-prob", type=float, nargs="+",
                    help="BENCHMARK-ONLY synthetic acceptance per draft position (one value: all)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                    help="random models' dtype (shipped: the Decoder's default)")
    ap.add_argument("--batch", type=int, nargs="+")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=256, help="random models' prompt tokens")
    ap.add_argument("--profile-seconds", type=float, default=10.0,
                    help="measuring budget of SPS(B) for sync/async when none is cached")
    ap.add_argument("--modes", nargs="+", default=[f"{m}/{p}" for m, p in MODES])
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.model != "shipped" and not args.accept_prob:
        ap.error("--model qwen3-8b / tiny (random weights) need --accept-prob")
    if args.accept_prob and any(not 0 <= p <= 1 for p in args.accept_prob):
        ap.error("--accept-prob values must lie in [0, 1]")
    known = {f"{m}/{p}" for m, p in MODES}
    if set(args.modes) - known:
        ap.error(f"--modes must be among {sorted(known)}")
    if args.batch is None:
        args.batch = [1, 8, 32, 128] if args.device.startswith("cuda") else [1, 4, 16]
    if args.device == "cpu":
        torch.set_num_threads(1)  # two shared cores: one thread is steadier (see bench/RESULTS.md)
    models = Models(args)
    if args.model == "shipped" and args.accept_prob:
        sys.exit("--accept-prob applies to the random-weight models only")
    header = device_header(torch.device(args.device))
    label = args.model + (f", SYNTHETIC acceptance {args.accept_prob}" if models.random else "")
    print(f"model: {label}; prompts {'random ' + str(args.prompt_len) + ' tokens' if models.random else 'code'}"
          f", {args.max_tokens} new tokens each, greedy")
    print(f"{'mode':14} {'batch':>5} {'tok/s':>9} {'user tok/s':>10} {'tau':>5} {'verify':>6} {'reads':>5}  "
          "phase shares (draft, sched, verify, accept, ctx, other)")
    rows = []
    for mp in args.modes:
        mode, policy = mp.split("/")
        for b in args.batch:
            r = run(models, mode, policy, b, args.max_tokens)
            rows.append(r)
            ps = r["phase_share"]
            share = " ".join(f"{ps.get(k, 0.0):.3f}" for k in PHASES)
            print(f"{mp:14} {b:5d} {r['tokens_per_s']:9.1f} {r['per_user_tokens_per_s']:10.1f} "
                  f"{r['tau']:5.2f} {r['mean_verify_length']:6.2f} {r['host_reads_per_round']:5.2f}  {share}"
                  + (f"  cuda syncs/round {r['cuda_syncs_per_round']:.2f}" if r["cuda_syncs_per_round"] is not None else ""),
                  flush=True)
            if args.json:  # after every row: a run cut short by a time limit keeps what it measured
                Path(args.json).write_text(json.dumps({"header": header, "model": label, "rows": rows},
                                                      indent=2))
    if args.plot:
        plot(rows, args.plot, f"throughput vs per-user speed: {label} on {args.device} (labels: batch)")
    return rows


if __name__ == "__main__":
    main()
