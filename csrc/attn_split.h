// How verify_attention's CUDA tensor-core path splits the KV range of its work units (split-KV):
// the choice by a cost model, shared by the device planner (AttnPlanKernel, one candidate per
// thread) and a host twin the tests call through the bindings.
//
// A unit is one (request, KV head, 64-row query tile) over `tiles` KV tiles of 64 keys. With
// chunk c, a unit of t tiles becomes S = ceil(t / c) items of near-equal size (ceil(t / S) tiles
// at most); the persistent kernel runs the items in waves of `target` co-resident blocks, and the
// last split of a unit to finish merges the S partials (the fused merge: it reads them one
// after another in one block). The cost of a plan, in eighths of a tile time (the time in which
// every co-resident block streams one K + V tile), is
//   max(HBM, block) + 8 x waves + S_max                                           (SplitScore)
//   HBM   = 8 W / target: every tile once at full bandwidth (W: tiles of all units);
//   block = 2 x waves x longest: a block streams alone at most 4 tiles per tile time (a quarter
//           of the grid, each with its two pipeline stages in flight, already saturates HBM:
//           264 x 64 KB against 4.3 TB/s x ~1 us of latency on an H200, head_dim 128);
//   8 x waves: one tile time per wave for an item's own Q load, first-tile latency and output;
//   S_max (when anything splits): the merge, 1/8 of a tile time per split (a 64-row float32
//           partial of head_dim 128 is 32 KB, read from L2 by one SM at ~64 B/clock).
// So a short batch is not cut into as many items as the GPU has blocks: R = 1 over 4k keys with
// 8 KV heads (65 tiles) takes S = 9 (72 items of 8 tiles, HBM still saturated, 9 partials to
// merge), not the 33 items of 2 tiles that fill the GPU once. The model is a proxy for choosing,
// not a timing. Candidates (SplitCandidate): no split, the fill-once chunk (ceil(W / target)),
// and every chunk from 2 tiles to the longest unit's up to 64k keys; plans with more split items
// than the 2 x target partial slots, or more than kMaxSplits splits of a unit (the merge stages
// its weights in shared memory), are refused.
#pragma once
#include "common.h"

namespace dspark {

constexpr int kMinSplitTiles = 2;      // a split covers at least 128 keys
constexpr int kSplitCandidates = 1024;  // one per thread of the planner's block
constexpr int kNoSplit = 0x7fffffff;   // the chunk that splits nothing
constexpr int kMaxSplits = 128;        // splits of one unit at most (the merge's shared weights)

// Items and the longest item of a plan, accumulated unit by unit.
struct SplitPlanCost {
  long long items = 0;
  long long work = 0;  // tiles of all units
  int longest = 0;     // tiles of the longest item
  int splits = 0;      // most splits of one unit
};

// The chunk that fills the GPU about once: ceil(W / target) of the work W (tiles of all units).
DSPARK_HD int FillOnceChunk(long long work, int target) {
  const long long c = (work + target - 1) / target;
  return c < kMinSplitTiles ? kMinSplitTiles : (c > kNoSplit ? kNoSplit : static_cast<int>(c));
}

// Candidate s of kSplitCandidates: 0 splits nothing, 1 fills the GPU about once (so the choice is
// never worse than that rule); then every chunk from 2 up when the longest unit has fewer than
// kSplitCandidates tiles (64k keys: the search is exhaustive), beyond that ceil(t_max / (s - 1)),
// the chunks that cut the longest unit differently.
DSPARK_HD int SplitCandidate(int t_max, int fill_once, int s) {
  if (s == 0) return kNoSplit;
  if (s == 1) return fill_once;
  if (t_max < kSplitCandidates) return s;
  const int c = (t_max + s - 2) / (s - 1);
  return c < kMinSplitTiles ? kMinSplitTiles : c;
}

DSPARK_HD void AddUnits(SplitPlanCost& pc, long long units, int tiles, int chunk) {
  const long long S = tiles > 0 ? (tiles + static_cast<long long>(chunk) - 1) / chunk : 1;
  const int len = tiles > 0 ? static_cast<int>((tiles + S - 1) / S) : 0;
  pc.items += units * S;
  pc.work += units * tiles;
  if (len > pc.longest) pc.longest = len;
  if (S > pc.splits) pc.splits = static_cast<int>(S < kNoSplit ? S : kNoSplit);
}

// Score of a plan (lower is better; see the top); -1: not allowed (more split items than
// partial slots, or more splits of a unit than the merge stages).
DSPARK_HD long long SplitScore(const SplitPlanCost& pc, long long units, int target) {
  const bool split = pc.items > units;
  if (split && (pc.items > 2ll * target || pc.splits > kMaxSplits)) return -1;
  const long long waves = (pc.items + target - 1) / target;
  const long long hbm = (8 * pc.work + target - 1) / target;
  const long long block = 2 * waves * pc.longest;
  return (hbm > block ? hbm : block) + 8 * waves + (split ? pc.splits : 0);
}

// Whether (score a, chunk a) beats (score b, chunk b): the lower score, then the larger chunk.
DSPARK_HD bool SplitBetter(long long sa, int ca, long long sb, int cb) {
  if (sa < 0) return false;
  if (sb < 0) return true;
  return sa < sb || (sa == sb && ca > cb);
}

// Host twin of the planner's choice: units[i] units of tiles[i] KV tiles each, n entries (those
// without units are skipped, as the planner skips requests without query rows).
inline int ChooseSplitChunk(const long long* units, const int* tiles, int n, int target) {
  long long U = 0, W = 0;
  int t_max = 0;
  for (int i = 0; i < n; ++i) {
    if (units[i] <= 0) continue;
    U += units[i];
    W += units[i] * tiles[i];
    if (tiles[i] > t_max) t_max = tiles[i];
  }
  if (U >= target || t_max <= 0) return kNoSplit;
  const int fill_once = FillOnceChunk(W, target);
  long long best_score = -1;
  int best = kNoSplit;
  for (int s = 0; s < kSplitCandidates; ++s) {  // s = 0: no split (the planner: thread s)
    const int c = SplitCandidate(t_max, fill_once, s);
    SplitPlanCost pc;
    for (int i = 0; i < n; ++i) {
      if (units[i] > 0) AddUnits(pc, units[i], tiles[i], c);
    }
    const long long score = SplitScore(pc, U, target);
    if (SplitBetter(score, c, best_score, best)) {
      best_score = score;
      best = c;
    }
  }
  return best;
}

}  // namespace dspark
