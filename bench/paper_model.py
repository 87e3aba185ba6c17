"""Paper estimates (a model, not a measurement) of markov_sample, rejection_sample and
verify_attention on an H200 at the benchmarks' goal shapes: today's kernels ("before") and the
kernels of the batch-1 / issue-bound redesign ("after"), each against its byte floor. What the
next GPU lease's `bench_kernels.py` rows are to be read against; the first measured run replaces
every assumption below.

    python bench/paper_model.py [--json PATH]

A phase that streams memory costs the slowest of four ceilings (`phase`): HBM bytes / 4.3 TB/s;
warp instructions / issue rate (132 SMs x 4 schedulers x 1 instruction a clock at 1.755 GHz);
tensor-core FLOPs / the mma.sync rate; bytes / (bytes in flight / HBM latency), Little's law. A
serial chain (a dependent load after a dependent load) costs its length x the latency (`chain`).
Launch gaps and kernel ramps add. Assumptions, each a stated guess:
  HBM 4.3 TB/s, latency 0.65 us; L2 latency 0.25 us; mma.sync bf16 600 TFLOP/s (about 60% of
  the dense peak: no wgmma); 1.755 GHz; a kernel waiting on its predecessor in a CUDA graph
  starts 1.5 us after it (plain) or 0.3 us (programmatic dependent launch), and needs ~1 us to
  get its blocks going (RAMP).
  Instruction counts per 128-entry item (a warp instruction covers 32 lanes x 4 entries) come
  from reading the kernels' inner loops, not from SASS (except markov's "before", the desk SASS
  count of issue 29): see the constants' comments.
markov_sample: the served bf16 head (bf16 W2 [V, r], bf16 U in, float32 z out), vanilla head with
  a Markov-feature confidence head (d 4096), T > 0, random logits (no pre-filtering: the most
  Philox work); W2 from HBM every step (77.8 MB > the 50 MB L2).
rejection_sample: float32 target logits, every request verifying gamma drafts of which it accepts
  ACCEPTED (then one rejection), T > 0; floor: bench_rejection_sample.must_move.
verify_attention: Qwen3-8B (32 query / 8 KV heads, head_dim 128, bf16, page size 16), 8 queries a
  request; each design with its own planner's split (the planners written again here; the test
  holds the new one to _C.attn_split_chunk); a wave's items start and end together, so each wave
  pays its serial start and its last tile's mma in full (an upper bound where waves stagger).
"""
import argparse
import json
import math

BW, LAT_HBM, LAT_L2 = 4.3e12, 0.65e-6, 0.25e-6
SMS, ISSUE, CLOCK = 132, 4, 1.755e9
MMA_RATE = 6.0e14
GAP_PLAIN, GAP_DEP, RAMP = 1.5e-6, 0.3e-6, 1.0e-6
BLOCKS = 264  # co-resident sweep / attention blocks (2 an SM)
NO_SPLIT = 0x7fffffff
L2_BYTES = 50e6


def phase(nbytes, warp_instr=0.0, flops=0.0, in_flight_per_sm=None):
    """Seconds of a streaming phase: the slowest of HBM, issue, tensor cores and latency."""
    t = [nbytes / BW, warp_instr / (SMS * ISSUE * CLOCK), flops / MMA_RATE]
    if in_flight_per_sm:
        t.append(nbytes * LAT_HBM / (in_flight_per_sm * SMS))
    return max(t)


def chain(n, latency):
    """Seconds of n dependent memory round trips."""
    return n * latency


# ---- markov_sample --------------------------------------------------------------------------------
# Warp instructions per 128-entry item, sampled (T > 0), Philox on every quad:
#   before: 1,000-1,500 (issue 29, SASS): per item a seed (warp max, ballot, one lane's Philox
#   and two double logs), OfferGumbel4, and a warp merge of the argmax and the log-sum-exp
#   (doubles through shuffles) plus lane 0's merge into its slot.
#   after: U load 1, bias LDS 1, adds 4, z store 1, max 3, log-sum-exp 20 (4 exp, a float sum,
#   one widening, one double add), Philox 75, 4 float Gumbels 48, compares 10, the pre-filter 5,
#   the warp's best 10, loop 10: ~190.
MARKOV_ITEM = {"before": 1250, "after": 190}
MARKOV_SLOT_REDUCE = 250  # after: a request's lanes merged once a block (double shuffles)
MARKOV_GATE_TRIPS = {"before": 32, "after": 8}  # gated head's step kernel, r = 256 (not priced
# at the goal shapes: vanilla head)


def markov_floor(R, gamma, V=151936, r=256, d=4096):
    w2 = V * r * 2
    passes = gamma if w2 > L2_BYTES else 1
    return ((2 + 4) * R * gamma * V + 2 * (passes * V * r + R * gamma * (r + d) + d + r + 1)
            + 36 * R + 20 * R * gamma) / BW


def markov(R, gamma, which, V=151936, r=256, d=4096):
    """Seconds of one markov_sample call: head projection + prologue + gamma steps."""
    items = R * math.ceil(V / 128)
    groups = math.ceil(R / 64)
    sweep_bytes = V * r * 2 + R * V * (2 + 4)
    instr = items * MARKOV_ITEM[which]
    if which == "after":
        instr += R * (BLOCKS // groups) * MARKOV_SLOT_REDUCE
    sweep = phase(sweep_bytes, instr, flops=2.0 * V * R * r)
    # serial per step: the sweep's e_eff (L2) and first W2 tile (HBM, half hidden by the
    # prefetch before its wait), its partials' store; the step kernel's partials (L2), W1 row
    # (HBM) and reductions (~0.5 us); two dependent launches
    sweep_tail = LAT_L2 + LAT_HBM / 2 + LAT_L2
    step = RAMP + LAT_L2 + LAT_HBM + 0.5e-6
    per_step = sweep + sweep_tail + step + 2 * GAP_DEP
    # head projection (confidence h part, N = R gamma vectors, d = 4096): before, a warp walks
    # d / 128 = 32 slabs one round trip each; after, a block's 8 warps walk 4 slabs each
    N = R * gamma
    slabs = {"before": d // 128, "after": d // (8 * 128)}[which]
    head = RAMP + chain(slabs, LAT_HBM) + phase(N * d * 2 + d * 2, N * d / 128 * 1.5) + GAP_PLAIN
    return head + step + GAP_PLAIN + gamma * per_step


# ---- rejection_sample -----------------------------------------------------------------------------
ACCEPTED = 5  # drafts a request accepts of gamma = 7 ("likely" drafts), then a rejection
# RowStats: warp instructions per 128-entry item: a test row's log-sum-exp 22 (before: 4 double
# adds, 30), a bonus row's Gumbel 190, loads 1-2; resident threads an SM: 3 blocks of 256 (70-80
# registers); in flight a thread: before one 16-byte float4 load (bf16: 8 bytes), after four.
REJ_ITEM = {"before": {"lse": 30, "gumbel": 190}, "after": {"lse": 22, "gumbel": 190}}
REJ_IN_FLIGHT = {"before": 768 * 16, "after": 768 * 4 * 16}


def rejection_floor(R, gamma=7, V=151936, a=ACCEPTED, tb=4):
    target_rows = R * (a + 1)
    rows = target_rows + (R if a < gamma else 0)
    tested = R * min(a + 1, gamma)
    return (tb * V * target_rows + 4 * V * (rows - target_rows) + 16 * tested + 32 * R + 4 + 4 * R
            + 8 * R * (gamma + 1)) / BW


def rejection(R, which, gamma=7, V=151936, a=ACCEPTED, tb=4):
    """Seconds of one rejection_sample call (every row of every request streamed once, the
    tested rows' drafts checked for NaN / inf, one residual row a rejecting request)."""
    nbytes = R * (gamma + 1) * V * tb + R * gamma * V * 4
    instr = (R * gamma * REJ_ITEM[which]["lse"] + R * REJ_ITEM[which]["gumbel"]) * V / 128
    rowstats = RAMP + phase(nbytes, instr, in_flight_per_sm=REJ_IN_FLIGHT[which])
    rejecting = R if a < gamma else 0
    resid = phase(rejecting * V * (tb + 4), rejecting * V / 128 * 60, in_flight_per_sm=768 * 2 * 16)
    # Decide: row partials (L2), the tests' P(x), q(x) (HBM), the residual sweep, then its merge:
    # before, a third launch (plain gap, ramp, an L2 read); after, an atomic ticket and an L2 read
    decide = GAP_PLAIN + RAMP + LAT_L2 + LAT_HBM + resid
    finish = GAP_PLAIN + RAMP + LAT_L2 if which == "before" else 2 * LAT_L2
    return rowstats + decide + finish


# ---- verify_attention -----------------------------------------------------------------------------
# A unit is one (request, KV head, 64-row query tile); the planner cuts its KV tiles into S splits.
# before: the wave-efficiency planner (_chunk_before), one warp per 16 rows on all 64 keys of a
# tile (2 of 4 warps busy at 32 rows), each item scanning its request's block table, a merge
# kernel launched whether or not anything split. after: csrc/attn_split.h's planner
# (_chunk_python), 2 or 4 warps sharing a tile's keys, the bad-page check in the plan kernel, the
# last split merging the unit (atomic ticket, attn_merge.cuh), no merge launch. Assumptions (the
# kernel header's): mma.sync m16n8k16 issues once per MMA_CLK clocks on an SM sub-partition,
# warp w on sub-partition w % 4; a block streams at most 4 K + V tiles per tile time (the time in
# which every co-resident block streams one); one SM reads L2 at 64 B a clock.
MMA_CLK = 8
L2_SM = 64 * CLOCK  # bytes / s
MIN_SPLIT, CANDIDATES, MAX_SPLITS = 2, 1024, 128  # attn_split.h kMinSplitTiles, ...


def _chunk_before(units, tiles, target):
    """The planner the redesign replaced: waves x (longest item + 1) x 50, + the same if split."""
    def score(c):
        S = [-(-t // c) for t in tiles]
        items = sum(u * s for u, s in zip(units, S))
        if items > sum(units) and items > 2 * target:
            return None
        work = -(-items // target) * (max(-(-t // s) for t, s in zip(tiles, S)) + 1)
        return work * 50 + (work if items > sum(units) else 0)
    scored = [(score(c), -c) for c in [NO_SPLIT, *range(2, max(tiles) + 1)]]
    return -min(x for x in scored if x[0] is not None)[1]


def _split_score(units, tiles, chunk, target):
    """attn_split.h SplitScore, in eighths of a tile time: max(HBM, a block's own stream) + 8 a
    wave + 1 a split of the most-split unit (the merge); None: more split items than partial
    slots, or more splits of a unit than the merge stages."""
    S = [-(-t // chunk) if t > 0 else 1 for t in tiles]
    items = sum(u * s for u, s in zip(units, S))
    split = items > sum(units)
    if split and (items > 2 * target or max(S) > MAX_SPLITS):
        return None
    waves = -(-items // target)
    hbm = -(-8 * sum(u * t for u, t in zip(units, tiles)) // target)
    longest = max(-(-t // s) if t > 0 else 0 for t, s in zip(tiles, S))
    return max(hbm, 2 * waves * longest) + 8 * waves + (max(S) if split else 0)


def _chunk_python(units, tiles, target):
    """attn_split.h ChooseSplitChunk (what _C.attn_split_chunk runs): the best of its 1024
    candidate chunks, ties to the larger chunk; entries without units take no part."""
    kept = [(u, t) for u, t in zip(units, tiles) if u > 0]
    if not kept or sum(u for u, _ in kept) >= target or max(t for _, t in kept) <= 0:
        return NO_SPLIT
    units, tiles = zip(*kept)
    t_max, work = max(tiles), sum(u * t for u, t in kept)
    fill_once = min(max(MIN_SPLIT, -(-work // target)), NO_SPLIT)
    best = (None, NO_SPLIT)
    for s in range(CANDIDATES):  # SplitCandidate
        c = (NO_SPLIT if s == 0 else fill_once if s == 1 else s if t_max < CANDIDATES
             else max(MIN_SPLIT, -(-t_max // (s - 1))))
        sc = _split_score(units, tiles, c, target)
        if sc is not None and (best[0] is None or (sc, -c) < (best[0], -best[1])):
            best = (sc, c)
    return best[1]


def attention_floor(R, ctx, n=8, h_q=32, h_kv=8, hd=128):
    return (R * (ctx + n) * h_kv * hd * 2 * 2 + 2 * R * n * h_q * hd * 2) / BW


def attention_plan(R, ctx, which, n=8, h_q=32, h_kv=8):
    """(units a request, rows of a unit's tile, tiles a unit, S): the split the planner picks."""
    rows = min(64, n * h_q // h_kv)
    units, tiles = h_kv * -(-n * h_q // h_kv // 64), -(-(ctx + n) // 64)
    plan = _chunk_before if which == "before" else _chunk_python
    chunk = NO_SPLIT if R * units >= BLOCKS else plan([units] * R, [tiles] * R, BLOCKS)
    return units, rows, tiles, 1 if chunk == NO_SPLIT else -(-tiles // chunk)


def attention(R, ctx, which, n=8, h_q=32, h_kv=8, hd=128, page_size=16):
    """Seconds of one verify_attention layer (its own launch gap, the same in both, left out)."""
    units, rows, tiles, S = attention_plan(R, ctx, which, n, h_q, h_kv)
    longest, items = -(-tiles // S), R * units * S
    waves = -(-items // BLOCKS)
    tile_time = BLOCKS * 64 * hd * 2 * 2 / BW
    # a tile's mma: hd / kw a warp (kw warps share its keys), as many warps on a sub-partition as
    # the SM holds blocks
    kw = 1 if which == "before" else (4 if rows <= 16 else 2 if rows <= 32 else 1)
    per_sm = min(BLOCKS // SMS, -(-min(items, BLOCKS) // SMS))
    mma_tile = hd // kw * MMA_CLK * per_sm / CLOCK
    stream = max(attention_floor(R, ctx, n, h_q, h_kv, hd), waves * longest * tile_time / 4,
                 waves * longest * mma_tile)
    # a wave's items start and end together: the item found (binary search over item_off, then
    # the request's fields in one round), before: its block-table scan (a round per 128 entries),
    # the block table, the first tile; at the end the last tile's mma, which no load hides
    scan = chain(-(-(-(-(ctx + n) // page_size)) // 128), LAT_L2) if which == "before" else 0
    per_wave = (1 + math.ceil(math.log2(R))) * LAT_L2 + scan + LAT_L2 + LAT_HBM + mma_tile
    t = RAMP + stream + waves * per_wave + LAT_L2  # + the last stores
    if which == "before":  # the merge kernel: a thread walks 8 rows x S partials, each load
        # behind the previous one's exp2 (desk SASS, issue 29)
        return t + GAP_PLAIN + RAMP + (chain(8 * S, LAT_L2) if S > 1 else 0)
    if S == 1:
        return t
    # after: partial stores fenced, the ticket (2 round trips); the last split's block loads the
    # S x 64 lse (1,024 a round), then the partials at its SM's L2 rate, in batches of 4 splits a
    # thread group (a batch past S rereads the last split), as many merges an SM as units / SMs
    outs = rows * hd // 4
    span = 128
    while span > 1 and span // 2 * 4 >= outs:
        span //= 2
    groups = 128 // span
    loaded = -(-S // (4 * groups)) * 4 * groups
    merge = (2 * LAT_L2 + math.ceil(S * 64 / 1024) * LAT_L2 + LAT_L2
             + -(-R * units // SMS) * loaded * rows * hd * 4 / L2_SM)
    return t + merge


# ---- report ------------------------------------------------------------------------------------------
def rows():
    out = []
    for gamma in (7, 16):
        for R in (1, 32, 256):
            out.append(dict(op="markov_sample", shape=f"R={R} gamma={gamma}", floor_us=markov_floor(R, gamma),
                            before_us=markov(R, gamma, "before"), after_us=markov(R, gamma, "after")))
    for R in (1, 32, 128, 256):
        out.append(dict(op="rejection_sample", shape=f"R={R} gamma=7", floor_us=rejection_floor(R),
                        before_us=rejection(R, "before"), after_us=rejection(R, "after")))
    for R, ctx in [(1, 4096), (8, 4096), (32, 4096), (128, 4096), (256, 4096), (32, 1024), (1, 32768),
                   (32, 32768)]:
        out.append(dict(op="verify_attention", shape=f"R={R} ctx={ctx}", floor_us=attention_floor(R, ctx),
                        before_us=attention(R, ctx, "before"), after_us=attention(R, ctx, "after"),
                        splits=[attention_plan(R, ctx, w)[3] for w in ("before", "after")]))
    for r in out:
        for k in ("floor_us", "before_us", "after_us"):
            r[k] *= 1e6
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    table = rows()
    units = {"markov_sample": "us a call (bf16 head, V 151936, r 256)",
             "rejection_sample": f"us a call (float32 target, V 151936, {ACCEPTED} of 7 accepted)",
             "verify_attention": "us a layer (Qwen3-8B heads, bf16, 8 queries a request; S: splits "
                                 "before -> after)"}
    assumes = {"markov_sample": "vanilla head + Markov-feature confidence (d 4096), T > 0, W2 from HBM every "
                                "step; warp instructions an item 1250 -> 190",
               "rejection_sample": "T > 0, one rejection a request; 16-byte loads in flight a thread 1 -> 4",
               "verify_attention": f"{BLOCKS} blocks; a block <= 4 tiles a tile time; an mma a sub-partition "
                                   f"every {MMA_CLK} clk; an SM reads L2 at 64 B/clk; L2 / HBM round trips "
                                   f"{LAT_L2 * 1e6} / {LAT_HBM * 1e6} us"}
    op = None
    for r in table:
        if r["op"] != op:
            op = r["op"]
            print(f"{op}: {units[op]}, model")
            print(f"  assumes: {assumes[op]}; HBM {BW / 1e12} TB/s, ramp {RAMP * 1e6} us (docstring)")
            print(f"{'shape':>16} {'floor':>8} {'before':>8} {'%':>5} {'after':>8} {'%':>5}")
        f, b, a = r["floor_us"], r["before_us"], r["after_us"]
        note = f"  S {r['splits'][0]} -> {r['splits'][1]}" if "splits" in r else ""
        print(f"{r['shape']:>16} {f:8.1f} {b:8.1f} {100 * f / b:5.0f} {a:8.1f} {100 * f / a:5.0f}{note}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(table, fh, indent=1)


if __name__ == "__main__":
    main()
