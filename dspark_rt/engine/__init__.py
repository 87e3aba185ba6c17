"""The engine: Engine (engine.py: owns the requests and the loop), its Processor (processing.py:
requests in, tokens and outputs out), and its bookkeeping in pure Python: the KV page manager
and the request scheduler (this module imports only those).

One BlockManager per paged cache (target, drafter), one RequestScheduler over both. Each step:

  out = sched.schedule()
  for req in out.preempted:   # already back in waiting with kv_len = ctx_len = 0, pages freed
      forget any per-request device state (the re-prefill rebuilds both caches)
  for c in out.prefills:      # req.target_pages / drafter_pages are set (copies)
      run tokens all_tokens(c.req)[c.start:c.end] at positions c.start..; target K/V slots for
      positions < c.target_from go to a scratch slot (shared cached pages are read, never
      written); drafter context for every position of the chunk; then sched.prefilled(c)
      (kv_len = max(kv_len, c.end), ctx_len = c.end)
      if c.is_last: no output yet -> sample the first token (round 0) and append it;
                    otherwise (resumed) anchor = output_ids[-1], nothing is sampled
  for req in out.decodes:     # pages cover kv_len + 1 + gamma, ctx_len + max(B, gamma + 1)
      one DSpark round (it also writes the drafter context of the anchor and accepted drafts);
      output_ids += emitted; sched.decoded(req, a + 1) (kv_len += a + 1, ctx_len = kv_len)
  for every request that hit a stop / max_tokens: sched.finish(request_id)
  (sched.abort(request_id) only between steps; it frees pages wherever the request is)

Prefix caching. Drafter context K/V of a position is a function of the token prefix (it is
projected from target features), so both caches are prefix-cached with the same chained hash.
On admission kv_len = the target's hit and ctx_len = the drafter's hit cut to it (ctx_len <=
kv_len); chunks start at ctx_len. With equal pools and page sizes the two hits are usually equal
and the whole prefix is skipped. When the drafter hits less (its pages evicted first, another
page size, or BlockManager(..., enable_prefix_caching=False) for the drafter: "rebuild" mode)
the target still shares its cached pages (memory) and the drafter context of
[ctx_len, kv_len) is rebuilt from target features: the target runs those positions again with
their K/V writes (below c.target_from) redirected to a scratch page, attending to the identical
K/V in the shared pages, purely to capture the features.
"""
from .block_manager import BlockManager, BlockManagerError
from .config import EngineConfig
from .scheduler import (PrefillChunk, RequestScheduler, SchedRequest, SchedulerOutput, all_tokens,
                        prefill_len)

__all__ = ["BlockManager", "BlockManagerError", "EngineConfig", "RequestScheduler", "SchedRequest",
           "SchedulerOutput", "PrefillChunk", "all_tokens", "prefill_len"]
