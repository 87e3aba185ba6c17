// How verify_attention's CUDA tensor-core path splits the KV range of its work units (split-KV):
// the choice by wave efficiency, shared by the device planner (AttnPlanKernel, one candidate per
// thread) and a host twin the tests call through the bindings.
//
// A unit is one (request, KV head, 64-row query tile) over `tiles` KV tiles of 64 keys. With
// chunk c, a unit of t tiles becomes S = ceil(t / c) items of near-equal size (ceil(t / S) tiles
// at most), and the persistent kernel runs the items in waves of `target` co-resident blocks.
// The cost of a plan is waves x (its longest item + one tile for an item's own Q load and
// partials), in tiles, plus 1/50 when anything splits (the merge). Filling the GPU "about once"
// (chunk = ceil(W / target)) can leave a second wave of a few items as slow as the first: 5
// requests of 8 KV heads over 4k context get chunk 10, 280 items of 10 tiles for 264 blocks, 2
// waves (cost 22); chunk 11 gives 240 items of 11 tiles, one wave (cost 12). The model ignores
// that a sparse wave streams faster per block: it is a proxy for choosing, not a timing.
// Candidates (SplitCandidate): no split, the fill-once chunk, and every chunk from 2 tiles to the
// longest unit's up to 64k keys, the items kept within the plan's 2 x target partial slots.
#pragma once
#include "common.h"

namespace dspark {

constexpr int kMinSplitTiles = 2;      // a split covers at least 128 keys
constexpr int kSplitCandidates = 1024;  // one per thread of the planner's block
constexpr int kNoSplit = 0x7fffffff;   // the chunk that splits nothing

// Items and the longest item of a plan, accumulated unit by unit.
struct SplitPlanCost {
  long long items = 0;
  int longest = 0;  // tiles
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
  if (len > pc.longest) pc.longest = len;
}

// Score of a plan (lower is better); -1: not allowed (more split items than partial slots).
DSPARK_HD long long SplitScore(const SplitPlanCost& pc, long long units, int target) {
  const bool split = pc.items > units;
  if (split && pc.items > 2ll * target) return -1;
  const long long work = (pc.items + target - 1) / target * (pc.longest + 1);
  return work * 50 + (split ? work : 0);
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
