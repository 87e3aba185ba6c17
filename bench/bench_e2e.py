"""End-to-end decoding: ar vs dflash vs dspark (fixed / sync / async) against batch size.

Per mode and batch size: tokens/s, per-user tokens/s, tau (tokens per round, bonus included),
mean verify length, device-to-host reads per round, and the per-round time split of the Round's
steps (draft: block forward, LM head and sequential head; scheduling; verify forward;
acceptance; drafter context update; the rest = engine scheduling, commit and bookkeeping;
dspark_rt.testing.phases). JSON with --json; a plot of throughput against
per-user speed with --plot.

Models: --model shipped (the tiny trained pair, real acceptance; the CPU default) or a
random-weight pair of real shapes (--model qwen3-8b on a GPU; qwen3-0.6b, float32, on a CPU:
the regime where a forward over 8 tokens costs about as much as over one; --model tiny checks
the path on a CPU), which needs --accept-prob: BENCHMARK-ONLY synthetic acceptance
(dspark_rt.testing.synthetic), one conditional acceptance probability per draft position (a
single value is used for all) or a preset name ("tau5": tau 5.05 at gamma 7).

--baseline adds the same target through Hugging Face transformers `generate` (greedy, the same
weights shared in memory) as mode "hf/generate": the outside baseline of plain decoding.
--repeats N runs every mode and batch N times, modes interleaved within each repetition, and
reports medians with the ratios the policy is judged on. A mode may carry "@exact=0" or
"@exact=1" (e.g. dspark/fixed@exact=0): that run sets DSPARK_EXACT, so the cost of the
row-invariant forward is measured against torch's GEMMs in the same run.
On a machine with a CUDA device but a dspark_rt._C without CUDA kernels it exits 2 before
measuring: the ops would silently fall back to the reference, and the numbers would read as the
kernels'.

    python bench/bench_e2e.py [--batch 1 4 16] [--max-tokens 48] [--json out.json] [--plot out.png]
    python bench/bench_e2e.py --device cuda --model qwen3-8b --accept-prob 0.8 --batch 1 8 32 128
    python bench/bench_e2e.py --model qwen3-0.6b --dtype fp32 --accept-prob tau5 --batch 1 8 32 \
        --modes ar/fixed dflash/fixed dspark/fixed dspark/auto --baseline --repeats 3
"""
import argparse
import contextlib
import gc
import os
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from dspark_rt import Decoder, SamplingParams, ops
from dspark_rt.testing import phases as phase_timer, synthetic
from dspark_rt.testing.random_models import SHAPES as RANDOM_SHAPES
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
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
                     "fp32": torch.float32}[args.dtype or "bf16"]
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
            dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(self.args.dtype)
            return Decoder.from_pretrained(PAIR / "target", drafter, mode=mode, policy=policy,
                                           device=self.device, calibration=cal, dtype=dtype, **kw)
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
        auto also gets the profiles of plain rounds, of rounds that verify no draft and of
        drafter context updates."""
        if self._sps is None:
            from dspark_rt.runner import Runner
            from dspark_rt.runner.profiling import load_or_profile_jointly
            if self.random:
                target, drafter = self._pair
            else:
                probe = Decoder.from_pretrained(PAIR / "target", PAIR / "dspark", device=self.device)
                target, drafter = probe.target, probe.drafter
            kw = dict(seconds=self.args.profile_seconds, max_batch=max(self.args.batch),
                      context_len=self.args.prompt_len if self.random else None, progress=False,
                      sparse=self.args.profile_grid == "sparse")
            spec = Runner(target, drafter, "dspark", 16, self.device)
            plain = Runner(target, None, "ar", 16, self.device)  # measured together, interleaved
            self._sps = tuple(load_or_profile_jointly([(spec, "spread"), (plain, "spread"),
                                                       (spec, "no_drafts"), (spec, "context")], **kw))
        return self._sps if policy == "auto" else self._sps[0]


    def hf_model(self):
        """The target as a transformers model over the same tensors (no copy), float32."""
        from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
        if not self.random:
            return AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
        target = self._pair[0]
        cfg = dict(RANDOM_SHAPES[self.args.model][0])
        cfg.pop("architectures", None)
        with torch.device("meta"):
            hf = Qwen3ForCausalLM(Qwen3Config(**cfg, dtype=target.dtype))
        state = {("lm_head.weight" if k == "lm_head_weight" else "model." + k): v
                 for k, v in target.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        hf.load_state_dict(state, strict=True, assign=True)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config).to(self.device)  # off meta
        return hf.eval()


def run_hf(models, batch, max_tokens):
    """transformers generate, greedy, max_tokens new tokens per prompt (equal-length prompts: no
    padding). Warm-up of a few tokens first, as for the runtime's modes."""
    hf = models.hf_model()
    prompts = models.prompts(batch)
    if isinstance(prompts[0], str):
        from dspark_rt.checkpoint.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(PAIR / "target")
        ids = [tok.encode(p) for p in prompts]
        # left-padded with each prompt's first token, so the batch is one tensor: a few context
        # tokens more than the runtime's run sees, which a decode step's cost hardly notices
        width = max(len(i) for i in ids)
        prompts = [[i[0]] * (width - len(i)) + i for i in ids]
    x = torch.tensor(prompts, device=models.device)
    gen = lambda n: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        gen(min(4, max_tokens))
        first = _timed(lambda: gen(1), models.device)[1]  # prefill and the first token
        out, secs = _timed(lambda: gen(max_tokens), models.device)
    tokens = (out.shape[1] - x.shape[1]) * batch
    gc.collect()
    rate = _decode_rate(tokens, secs, batch, first)
    return {"mode": "hf", "policy": "generate", "batch": batch, "tokens": tokens, "seconds": secs,
            "prefill_seconds": first, "tokens_per_s": rate, "per_user_tokens_per_s": rate / batch,
            "e2e_tokens_per_s": tokens / secs,
            "tau": 1.0, "mean_verify_length": 0.0, "rounds": out.shape[1] - x.shape[1],
            "host_reads_per_round": float("nan"), "cuda_syncs_per_round": None, "phase_share": {}}


def _timed(fn, device):
    """(fn's result, seconds it took, the device drained before and after)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _decode_rate(tokens: int, secs: float, batch: int, first: float) -> float:
    """transformers' decoding tokens/s: the tokens after each request's first over the time
    after the first token, where `first` is a run of max_new_tokens = 1 (prefill and first
    token) of the same prompts."""
    return (tokens - batch) / max(secs - first, 1e-9) if tokens > batch else tokens / secs


def _decode_timed(dec, prompts, max_tokens, device):
    """The requests through the Decoder's Engine, step by step (it was sized for them by the
    warm-up): the steps until every request has its first token (prefill) are timed apart from
    the decoding steps after them. Returns (outputs, prefill seconds, decoding seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng = dec.engine
    reqs = [eng.make_request(p, params, i) for i, p in enumerate(prompts)]
    eng.add_all(reqs)
    _sync(device)
    t0 = time.perf_counter()
    while any(not q.output_ids and not q.finished for q in reqs):
        eng.step()
    _sync(device)
    t1 = time.perf_counter()
    while any(not q.finished for q in reqs):
        eng.step()
    _sync(device)
    return [eng.output(q) for q in reqs], t1 - t0, time.perf_counter() - t1


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


_DECODERS = {}  # one Decoder per mode, kept across batch sizes and repetitions


def run(models, mode, policy, batch, max_tokens):
    if (mode, policy) not in _DECODERS:
        _DECODERS[(mode, policy)] = (models.decoder(mode, policy), set())
    dec, warm = _DECODERS[(mode, policy)]
    prompts = models.prompts(batch)
    # warm-up, once per batch size: the same run, so that the KV pool is sized for it, kernels
    # are loaded and (on a GPU) every CUDA graph bucket the timed run replays is captured
    if batch not in warm:
        _generate(dec, prompts, max_tokens)
        warm.add(batch)
    r, e = dec.runner, dec.engine
    on_gpu = models.device.type == "cuda"
    # The phase split costs a device sync per phase on a GPU: there it gets a separate, shorter
    # pass; on the CPU timing the phases costs nothing and the timed run records them.
    times = {} if on_gpu else phase_timer.install(dec)
    _sync(models.device)
    reads0, rounds0 = e.round_host_reads, e.num_rounds
    outs, first, secs = _decode_timed(dec, prompts, max_tokens, models.device)
    split_secs = secs
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
    # other: engine bookkeeping and commit
    phases["other"] = max(0.0, split_secs - sum(phases.values()))
    syncs = count_cuda_syncs(dec, prompts[: min(batch, 4)], 16)
    tokens = sum(len(o.token_ids) for o in outs)
    m = [o.metrics for o in outs]
    n_rounds = sum(x.num_rounds for x in m)
    rate = (tokens - batch) / secs  # the first tokens came with the prefill, before the clock
    row = {"mode": mode, "policy": policy, "batch": batch, "tokens": tokens, "seconds": secs,
           "prefill_seconds": first, "tokens_per_s": rate, "per_user_tokens_per_s": rate / batch,
           # the whole request, prefill included, as generate() returns it
           "e2e_tokens_per_s": tokens / (first + secs),
           "tau": (sum(x.num_accepted_tokens for x in m) + n_rounds) / n_rounds if n_rounds else 1.0,
           "mean_verify_length": sum(x.num_draft_tokens for x in m) / n_rounds if n_rounds else 0.0,
           "rounds": rounds, "host_reads_per_round": reads, "cuda_syncs_per_round": syncs,
           "phase_share": {k: v / split_secs for k, v in phases.items()},
           # per round, everything but the two models' forwards (scheduling, metadata, policy,
           # acceptance incl. its sampling op, commit, bookkeeping), in microseconds
           "outside_forwards_us": 1e6 * (split_secs - sum(phases.get(k, 0.0) for k in
                                                          ("draft", "verify_forward", "context_update")))
                                  / max(1, rounds if not on_gpu else e.num_rounds - rounds0 - rounds)}
    if models.random and mode != "ar":
        row["synthetic_accept_prob"] = models.accept_prob(dec.runner.gamma)
    if r.graphs is not None:
        row["cuda_graphs"] = dict(r.graphs.stats)
    del outs
    gc.collect()
    if models.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def plot(rows, path, title):
    """Left: total tokens/s against batch size per mode; right: total against per-user tokens/s
    (labels: batch)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_batch, ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, policy in MODES + [("hf", "generate")]:
        pts = sorted((r for r in rows if r["mode"] == mode and r["policy"] == policy),
                     key=lambda r: r["batch"])
        if not pts:
            continue
        style = "s--" if mode == "hf" else "o-"
        by_batch.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], style,
                      label=f"{mode}/{policy}")
        ax.plot([r["per_user_tokens_per_s"] for r in pts], [r["tokens_per_s"] for r in pts], style,
                label=f"{mode}/{policy}")
        for r in pts:
            ax.annotate(str(r["batch"]), (r["per_user_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
    by_batch.set_xscale("log", base=2)
    by_batch.set_xlabel("batch size (requests)")
    by_batch.set_ylabel("total tokens/s")
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("total tokens/s")
    fig.suptitle(title, fontsize=9)
    by_batch.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="shipped", choices=["shipped", *sorted(RANDOM_SHAPES)],
                    help="shipped: the trained tiny pair; the others: random weights of those "
                         "shapes with synthetic acceptance (needs --accept-prob)")
    ap.add_argument("--accept-prob", nargs="+",
                    help="BENCHMARK-ONLY synthetic acceptance per draft position (one value: all; "
                         f"or a preset: {sorted(synthetic.PRESETS)})")
    ap.add_argument("--baseline", action="store_true",
                    help="also the target through transformers generate (mode hf/generate)")
    ap.add_argument("--repeats", type=int, default=1, help="repetitions, modes interleaved")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--profile-grid", choices=["dense", "sparse"], default="dense",
                    help="B values of the measured profiles (sparse: powers of two)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="the models' dtype (default: bf16 for random models, the Decoder's "
                         "default for the shipped pair: float32 on a CPU)")
    ap.add_argument("--batch", type=int, nargs="+")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=256, help="random models' prompt tokens")
    ap.add_argument("--profile-seconds", type=float, default=10.0,
                    help="measuring budget of SPS(B) for sync/async when none is cached")
    ap.add_argument("--modes", nargs="+", default=[f"{m}/{p}" for m, p in MODES])
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if (args.device.startswith("cuda") or torch.cuda.is_available()) and "cuda" not in ops.available_backends():
        sys.exit(f"bench_e2e: a CUDA device is present but dspark_rt._C has no CUDA kernels (backends "
                 f"{ops.available_backends()}): build with DSPARK_CUDA=1 first; nothing measured")
    if args.model != "shipped" and not args.accept_prob:
        ap.error("--model qwen3-8b / tiny (random weights) need --accept-prob")
    if args.accept_prob:
        if len(args.accept_prob) == 1 and args.accept_prob[0] in synthetic.PRESETS:
            args.accept_prob = synthetic.PRESETS[args.accept_prob[0]]
        try:
            args.accept_prob = [float(p) for p in args.accept_prob]
        except ValueError:
            ap.error(f"--accept-prob takes probabilities or one of {sorted(synthetic.PRESETS)}")
    if args.accept_prob and any(not 0 <= p <= 1 for p in args.accept_prob):
        ap.error("--accept-prob values must lie in [0, 1]")
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be >= 1")
    known = {f"{m}/{p}" for m, p in MODES}
    bad = [m for m in args.modes if m.partition("@exact=")[0] not in known
           or m.partition("@exact=")[2] not in ("", "0", "1")]
    if bad:
        ap.error(f"--modes must be among {sorted(known)}, each optionally with @exact=0 or "
                 f"@exact=1; got {bad}")
    if args.batch is None:
        args.batch = [1, 8, 32, 128] if args.device.startswith("cuda") else [1, 4, 16]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # two shared cores: one thread is steadier (RESULTS.md)
    models = Models(args)
    if args.model == "shipped" and args.accept_prob:
        sys.exit("--accept-prob applies to the random-weight models only")
    header = device_header(torch.device(args.device))
    label = args.model + (f", SYNTHETIC acceptance {args.accept_prob}" if models.random else "")
    print(f"model: {label}; prompts {'random ' + str(args.prompt_len) + ' tokens' if models.random else 'code'}"
          f", {args.max_tokens} new tokens each, greedy")
    print(f"{'mode':14} {'batch':>5} {'tok/s':>9} {'user tok/s':>10} {'tau':>5} {'verify':>6} {'reads':>5}  "
          "phase shares (draft, sched, verify, accept, ctx, other)  us/round outside the forwards")
    modes = list(args.modes) + (["hf/generate"] if args.baseline else [])
    rows, all_rows = [], []
    for rep in range(args.repeats):
        for b in args.batch:
            for mp in modes:  # interleaved: a load that comes and goes hits every mode alike
                spec, _, exact = mp.partition("@exact=")
                mode, policy = spec.split("/")
                with _exact(exact):
                    r = run_hf(models, b, args.max_tokens) if mode == "hf" else \
                        run(models, mode, policy, b, args.max_tokens)
                if exact:
                    r["policy"] += f"@exact={exact}"
                r["repeat"] = rep
                all_rows.append(r)
                ps = r["phase_share"]
                share = " ".join(f"{ps.get(k, 0.0):.3f}" for k in PHASES)
                print(f"{mp:14} {b:5d} {r['tokens_per_s']:9.1f} {r['per_user_tokens_per_s']:10.1f} "
                      f"{r['tau']:5.2f} {r['mean_verify_length']:6.2f} {r['host_reads_per_round']:5.2f}  {share}"
                      + (f"  {r['outside_forwards_us']:8.0f}" if "outside_forwards_us" in r else "")
                      + (f"  cuda syncs/round {r['cuda_syncs_per_round']:.2f}" if r["cuda_syncs_per_round"] is not None else ""),
                      flush=True)
                rows = medians(all_rows) if args.repeats > 1 else all_rows
                if args.json:  # after every row: a run cut short by a time limit keeps what it measured
                    Path(args.json).write_text(json.dumps({"header": header, "model": label,
                                                           "rows": rows, "runs": all_rows}, indent=2))
    if args.repeats > 1 or args.baseline:
        print(summary(rows, args.batch))
    if args.plot:
        plot(rows, args.plot, f"throughput vs per-user speed: {label} on {args.device} (labels: batch)")
    return rows


@contextlib.contextmanager
def _exact(value: str):
    """DSPARK_EXACT=value for one run ("": as the environment says): a mode written
    "dspark/fixed@exact=0" runs the same decoder with torch's GEMMs, interleaved with the rest,
    so the cost of row invariance is a ratio within one run."""
    if not value:
        yield
        return
    if value not in ("0", "1"):
        sys.exit(f"bench_e2e: @exact= takes 0 or 1, got {value!r}")
    saved = os.environ.get("DSPARK_EXACT")
    os.environ["DSPARK_EXACT"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["DSPARK_EXACT"]
        else:
            os.environ["DSPARK_EXACT"] = saved


def medians(runs):
    """One row per (mode, policy, batch): the run of median tokens/s (its other figures too),
    with every repetition's tokens/s kept."""
    groups = {}
    for r in runs:
        groups.setdefault((r["mode"], r["policy"], r["batch"]), []).append(r)
    out = []
    for g in groups.values():
        ranked = sorted(g, key=lambda r: r["tokens_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in g)
        row["per_user_tokens_per_s"] = row["tokens_per_s"] / row["batch"]
        row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in g]
        row["e2e_tokens_per_s"] = statistics.median(r["e2e_tokens_per_s"] for r in g)
        out.append(row)
    return out


def summary(rows, batches) -> str:
    """Median tokens/s per mode and batch, and the ratios the auto policy is judged on."""
    tps = {(r["mode"] + "/" + r["policy"], r["batch"]): r["tokens_per_s"] for r in rows}
    names = sorted({k[0] for k in tps}, key=lambda m: [f"{a}/{b}" for a, b in MODES + [("hf", "generate")]].index(m)
                   if m in [f"{a}/{b}" for a, b in MODES + [("hf", "generate")]] else 99)
    lines = ["median tokens/s  " + "  ".join(f"batch {b:>4}" for b in batches)]
    for m in names:
        lines.append(f"{m:16} " + "  ".join(f"{tps.get((m, b), float('nan')):10.1f}" for b in batches))
    ratios = [(f"{m[:-len('@exact=0')]} exact / torch GEMMs", m[:-len("@exact=0")], (m,))
              for m in names if m.endswith("@exact=0")]
    ratios += [("dspark/auto / max(ar, dspark/fixed)", "dspark/auto", ("ar/fixed", "dspark/fixed")),
              ("dspark/auto / ar", "dspark/auto", ("ar/fixed",)),
              ("dspark/fixed / ar", "dspark/fixed", ("ar/fixed",)),
              ("ar / hf generate, prefill included", "ar/fixed", ("hf/generate",))]
    e2e = {(r["mode"] + "/" + r["policy"], r["batch"]): r["e2e_tokens_per_s"] for r in rows}
    for label, num, dens in ratios:
        src = e2e if "prefill" in label else tps  # one method for both sides of a ratio
        vals = []
        for b in batches:
            den = [src[(d, b)] for d in dens if (d, b) in src]
            vals.append(src[(num, b)] / max(den) if (num, b) in src and den else float("nan"))
        if any(v == v for v in vals):
            lines.append(f"{label:36} " + "  ".join(f"{v:.2f}" for v in vals))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
