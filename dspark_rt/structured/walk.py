"""The per-round walk of the grammar matchers (DESIGN §6, constrained decoding).

Per request with a grammar, one matcher at its committed prefix. Each round:
    first_masks     the committed state's mask: draft position 1 and (plain rounds) row 0
    verify_masks    row k is masked with the state after the committed prefix AND the drafts
                    x_1 .. x_k before it; the walk stops at the first draft the grammar refuses
                    (P' = 0 there, so acceptance stops: later rows need no mask), then the
                    matcher rolls back to the committed prefix
    commit          the emitted tokens x_1 .. x_a, y advance it (y comes from a masked row, so
                    the grammar always takes it)
A matcher is anything with fill(words) (writes its state's int32 bitmask row), accept(token)
-> bool, rollback(n), terminated and complete (a whole match so far); compiler(params, V) makes one (grammar.py: xgrammar).
"""
import time

import numpy as np
import torch


def words_of(V: int) -> int:
    return (V + 31) // 32


class Constraints:
    """The matchers of the requests that ask for structured output, keyed by request id."""

    def __init__(self, compiler=None):
        self.compiler = compiler
        self.matchers: dict = {}
        self.host_s = 0.0  # host seconds of the round spent on the grammar (the round adds them)
        self.walks = 0     # verify walks (rounds with a grammar) so far

    def of(self, batch, V: int) -> list | None:
        """Each request's matcher (None: no grammar), or None when no request has one."""
        specs = getattr(batch.sampling, "structured_outputs", None)
        if not specs or all(s is None for s in specs):
            return None
        if self.compiler is None:
            raise ValueError("structured_outputs: this engine has no grammar compiler "
                             "(a target without a tokenizer)")
        out = []
        for rid, spec in zip(batch.ids, specs):
            if spec is not None and rid not in self.matchers:
                self.matchers[rid] = self.compiler(spec, V)
            out.append(self.matchers.get(rid) if spec is not None else None)
        return out

    def first_masks(self, ms: list, V: int, device) -> torch.Tensor:
        """[R, words] int32: each request's committed state (all ones without a grammar, or after
        it completed: only a request that ignores eos decodes on)."""
        rows = np.full((len(ms), words_of(V)), -1, dtype=np.int32)
        for r, m in enumerate(ms):
            if m is not None and not m.terminated:
                m.fill(rows[r])
        return torch.from_numpy(rows).to(device)

    def verify_masks(self, ms: list, drafts: list, lengths: list, V: int, device) -> torch.Tensor:
        """[sum(l_r + 1), words] int32: row k of request r masked with the state after its
        committed prefix and x_1 .. x_k; rows after the first refused draft stay all ones."""
        rows = np.full((sum(n + 1 for n in lengths), words_of(V)), -1, dtype=np.int32)
        at = 0
        self.walks += 1
        for m, xs, n in zip(ms, drafts, lengths):
            if m is not None and not m.terminated:
                m.fill(rows[at])
                walked = 0
                for k in range(n):
                    if not m.accept(int(xs[k])):
                        break  # P'(x_{k+1}) = 0: the acceptance stops at this row
                    walked += 1
                    if m.terminated:  # x_{k+1} ended the grammar (a stop token): so does the
                        break         # request, and the rows after it need no mask
                    m.fill(rows[at + k + 1])
                m.rollback(walked)
            at += n + 1
        return torch.from_numpy(rows).to(device)

    def commit(self, ids: list, ms: list, out_tokens: list, num_accepted: list, failed: list):
        """Advances every matcher by the request's emitted tokens (a completed grammar takes no
        more); a failed request drops its matcher, a finished one waits for drop()."""
        t0 = time.perf_counter()
        for rid, m, toks, a, bad in zip(ids, ms, out_tokens, num_accepted, failed):
            if m is None:
                continue
            for t in toks[:a + 1]:
                if bad or m.terminated or not m.accept(int(t)):
                    break
            if bad:
                self.matchers.pop(rid, None)
        self.host_s += time.perf_counter() - t0

    def complete(self, rid) -> bool | None:
        """Whether request rid's output so far is a whole match of its grammar (None: it has no
        matcher: no grammar, or no token taken yet)."""
        m = self.matchers.get(rid)
        return None if m is None else m.complete

    def drop(self, rid):
        """A request finished or was aborted: its matcher goes."""
        self.matchers.pop(rid, None)
