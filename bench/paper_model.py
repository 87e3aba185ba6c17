"""Paper estimates (a model, not a measurement) of markov_sample and verify_attention on an H200 at
the benchmarks' goal shapes, before and after the schedule changes of 2026-12-02: what the next
GPU lease's `bench_kernels.py` rows are to be read against.

    python bench/paper_model.py [--json PATH]

Assumptions (each a stated guess; a lent GPU replaces them):
  HBM streams 4.3 TB/s sustained; 132 SMs, 2 co-resident blocks each for both kernels (264);
  inside a CUDA graph a kernel waiting on its predecessor starts ~1.5 us after it ends, ~0.3 us
  as a programmatic dependent launch; markov's step kernel (one block per request: merge 264
  partials, a W1 row, the gate) takes ~3 us; L2 serves the later request groups' W2 tiles
  without HBM traffic; an attention work item streams its KV tiles at the wave's share of HBM,
  and costs one tile more for its own Q load and output (the planner's model, attn_split.h).

markov_sample, the served bf16 model (bf16 W2 [V, r], float32 z), per drafting call:
  before: the LM head's bf16 U cast to float32 (2 + 4 B) and copied into the CUDA graph's buffer
  (4 + 4 B), then per group of <= 64 requests, one after another, per step: a sweep reading W2
  from HBM and U (4 B), writing z (4 B), a plain launch gap, the step kernel, a gap.
  after: per step one sweep for all groups (W2 from HBM once), U read in bf16 (2 B), z written
  (4 B); dependent launches, the sweep's W2 prefetch (up to 32 KB a block) overlapping the step
  kernel.
  floor: the benchmark's must_move at the served dtypes / 4.3 TB/s.
verify_attention (Qwen3-8B: 32 query / 8 KV heads, head_dim 128, bf16, 8 queries a request),
per layer: before, the split that fills the GPU about once; after, the wave-efficient split
(_C.attn_split_chunk when the extension is built, else the same search in Python). floor: K, V,
Q and the output once / 4.3 TB/s.
"""
import argparse
import json
import math

BW = 4.3e12           # B/s
BLOCKS = 264          # co-resident blocks (2 per SM x 132)
GAP_PLAIN, GAP_DEP = 1.5e-6, 0.3e-6
STEP_KERNEL = 3e-6
NO_SPLIT = 0x7fffffff


def markov(R, gamma, V=151936, r=256, d=4096):
    w2 = V * r * 2
    elems = R * gamma * V
    per_req = R * gamma * (r + d) * 2 + 36 * R + 20 * R * gamma
    floor = ((2 + 4) * elems + gamma * w2 + per_req) / BW
    groups = math.ceil(R / 64)
    casts = (6 + 8) * elems / BW  # cast pass + graph-buffer copy
    step_bytes_group = lambda g: w2 + 8 * g * V
    before = casts
    for g0 in range(0, R, 64):
        g = min(64, R - g0)
        before += gamma * (step_bytes_group(g) / BW + STEP_KERNEL + 2 * GAP_PLAIN) + STEP_KERNEL + GAP_PLAIN
    del groups
    prefetch = min(BLOCKS * 32 * 1024 / BW, STEP_KERNEL)  # W2 the sweep streams while it waits
    after = gamma * ((w2 + 6 * R * V) / BW + STEP_KERNEL + 2 * GAP_DEP - prefetch) + STEP_KERNEL + GAP_PLAIN
    return floor, before, after


def _chunk_python(units, tiles, target):
    def score(c):
        S = [-(-t // c) for t in tiles]
        items = sum(u * s for u, s in zip(units, S))
        longest = max(-(-t // s) for t, s in zip(tiles, S))
        split = items > sum(units)
        if split and items > 2 * target:
            return None
        work = -(-items // target) * (longest + 1)
        return work * 50 + (work if split else 0)
    best = None
    for c in [NO_SPLIT, *range(2, max(tiles) + 1)]:
        s = score(c)
        if s is not None and (best is None or (s, -c) < best[0]):
            best = ((s, -c), c)
    return best[1]


def _wave_chunk(units, tiles, target):
    if sum(units) >= target:
        return NO_SPLIT
    try:
        from dspark_rt import _C
        return _C.attn_split_chunk(units, tiles, target)
    except ImportError:
        return _chunk_python(units, tiles, target)


def attention(R, ctx, n=8, h_q=32, h_kv=8, hd=128):
    L = ctx + n
    tiles, units = math.ceil(L / 64), h_kv * math.ceil(n * h_q // h_kv / 64)
    kv = R * L * h_kv * hd * 2 * 2
    qo = 2 * R * n * h_q * hd * 2
    floor = (kv + qo) / BW
    tile_time = BLOCKS * 64 * hd * 2 * 2 / BW  # one 64-key K + V tile in every block

    def run(chunk):
        S = 1 if chunk == NO_SPLIT else max(1, -(-tiles // chunk))
        items = R * units * S
        t = math.ceil(items / BLOCKS) * (math.ceil(tiles / S) + 1) * tile_time
        if S > 1:  # partials written and merged: O (64 x hd floats) and lse per item
            t += 2 * items * 64 * (hd + 1) * 4 / BW + GAP_PLAIN
        return t

    U, W = R * units, R * units * tiles
    before = NO_SPLIT if U >= BLOCKS else max(2, -(-W // BLOCKS))
    after = _wave_chunk([units] * R, [tiles] * R, BLOCKS)
    return floor, run(before), run(after)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    rows = []
    print("markov_sample (bf16 head, V 151936, r 256): us per call, model")
    print(f"{'R':>4} {'gamma':>5} {'floor':>8} {'before':>8} {'%':>5} {'after':>8} {'%':>5}")
    for gamma in (7, 16):
        for R in (1, 32, 256):
            f, b, a = markov(R, gamma)
            rows.append(dict(op="markov_sample", R=R, gamma=gamma, floor_us=f * 1e6, before_us=b * 1e6, after_us=a * 1e6))
            print(f"{R:>4} {gamma:>5} {f * 1e6:8.1f} {b * 1e6:8.1f} {100 * f / b:5.0f} {a * 1e6:8.1f} {100 * f / a:5.0f}")
    print("verify_attention (Qwen3-8B heads, bf16, 8 queries a request): us per layer, model")
    print(f"{'R':>4} {'ctx':>6} {'floor':>8} {'before':>8} {'%':>5} {'after':>8} {'%':>5}")
    for R, ctx in [(1, 4096), (5, 4096), (8, 4096), (13, 4096), (32, 4096), (128, 4096), (256, 4096),
                   (32, 1024), (1, 32768), (8, 32768), (32, 32768)]:
        f, b, a = attention(R, ctx)
        rows.append(dict(op="verify_attention", R=R, ctx=ctx, floor_us=f * 1e6, before_us=b * 1e6, after_us=a * 1e6))
        print(f"{R:>4} {ctx:>6} {f * 1e6:8.1f} {b * 1e6:8.1f} {100 * f / b:5.0f} {a * 1e6:8.1f} {100 * f / a:5.0f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
