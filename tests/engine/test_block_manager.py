"""BlockManager: allocation, errors, prefix-cache hits / misses / eviction, and a stateful
property test that simulates the K/V each page holds."""
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 precondition, rule)

from dspark_rt.engine import BlockManager, BlockManagerError


def test_allocate_grows_and_frees():
    bm = BlockManager(8, 4, name="t")
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []          # 8 tokens still fit 2 pages
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2] and bm.num_free == 5 and bm.num_used == 3
    assert bm.can_allocate(20) and not bm.can_allocate(21)
    assert bm.can_allocate(32, "a") and not bm.can_allocate(33, "a")
    bm.free("a")
    assert bm.num_free == 8 and bm.num_seqs == 0
    bm.check()


def test_errors_name_sequence_and_numbers():
    bm = BlockManager(4, 2, name="target")
    bm.allocate(7, 6)
    with pytest.raises(BlockManagerError, match=r"target.*sequence 8 needs 2 more pages to cover "
                                                r"4 tokens.*1 of 4 free"):
        bm.allocate(8, 4)
    assert not bm.has_seq(8) and bm.num_free == 1   # a failed allocation changes nothing
    bm.free(7)
    with pytest.raises(BlockManagerError, match="sequence 7 was already freed"):
        bm.free(7)
    with pytest.raises(BlockManagerError, match="unknown sequence 9"):
        bm.free(9)
    with pytest.raises(BlockManagerError, match="unknown sequence 9"):
        bm.block_table(9)
    bm.match_prefix(1, [1, 2, 3])
    with pytest.raises(BlockManagerError, match="sequence 1 already holds"):
        bm.match_prefix(1, [1, 2, 3])
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0, 4)


def _run(bm, seq, tokens, committed=None):
    """A sequence that matches, allocates and commits `tokens` (committed of them final)."""
    pages, n = bm.match_prefix(seq, tokens, len(tokens) - 1)
    bm.allocate(seq, len(tokens))
    bm.commit_full_pages(seq, tokens[:len(tokens) if committed is None else committed])
    return pages, n


def test_prefix_hits_misses_and_partial_pages():
    bm = BlockManager(16, 4)
    toks = list(range(100, 114))                       # 14 tokens: 3 full pages + 2
    assert _run(bm, "a", toks) == ([], 0)
    a_pages = bm.block_table("a")
    assert [bm.page_hash(p) is not None for p in a_pages] == [True, True, True, False]
    # Same prompt: the last position stays uncached (its logits are needed) -> 3 pages.
    assert bm.match_prefix("b", toks, len(toks) - 1) == (a_pages[:3], 12)
    assert [bm.ref_count(p) for p in a_pages] == [2, 2, 2, 1]
    # Exactly 3 pages long: max_tokens = 11 only allows 2 full pages.
    assert bm.match_prefix("c", toks[:12], 11) == (a_pages[:2], 8)
    # A different page 1 stops the chain there; a different first token misses entirely.
    other = toks[:4] + [0] + toks[5:]
    assert bm.lookup_prefix(other) == a_pages[:1]
    assert bm.lookup_prefix([1] + toks[1:]) == []
    # The chain hash is positional: page 1's tokens at page 0 do not hit.
    assert bm.lookup_prefix(toks[4:8] + toks[4:8]) == []
    for s in "abc":
        bm.free(s)
    assert bm.num_free == 16 and bm.num_evictable == 3
    bm.check()


def test_speculative_tail_is_never_cached():
    bm = BlockManager(8, 4)
    toks = list(range(12))
    bm.match_prefix("a", toks)
    bm.allocate("a", 12)                               # kv_len 6 + anchor + 5 drafts written
    assert bm.commit_full_pages("a", toks[:6]) == 1    # only the page below kv_len
    assert bm.lookup_prefix(toks) == bm.block_table("a")[:1]
    assert bm.commit_full_pages("a", toks[:9]) == 1
    assert bm.commit_full_pages("a", toks[:9]) == 0    # idempotent
    assert len(bm.lookup_prefix(toks)) == 2


def test_shared_pages_survive_one_owner():
    bm = BlockManager(8, 2)
    toks = [5, 6, 7, 8, 9]
    _run(bm, "a", toks)
    pages, n = _run(bm, "b", toks)
    assert n == 4 and bm.block_table("b")[:2] == pages
    bm.free("a")
    assert [bm.ref_count(p) for p in pages] == [1, 1] and bm.num_evictable == 0
    bm.free("b")
    assert bm.num_evictable == 2 and bm.num_free == 8
    bm.check()


def test_duplicate_content_keeps_first_copy():
    bm = BlockManager(8, 2)
    toks = [1, 2, 3, 4]
    bm.match_prefix("a", toks), bm.match_prefix("b", toks)   # both miss: nothing cached yet
    bm.allocate("a", 4), bm.allocate("b", 4)
    assert bm.commit_full_pages("a", toks) == 2
    assert bm.commit_full_pages("b", toks) == 0
    assert bm.lookup_prefix(toks) == bm.block_table("a")
    bm.free("b")
    assert bm.num_evictable == 0                  # b's private copies went to the free list
    bm.check()


def test_eviction_prefers_free_pages_then_lru_tail_first():
    bm = BlockManager(6, 2)
    _run(bm, "a", [1, 2, 3, 4, 5, 6])           # pages 0 1 2, all cached
    _run(bm, "b", [7, 8, 9, 10])                # pages 3 4
    bm.free("a"), bm.free("b")                  # LRU order: a's 2 1 0, then b's 4 3
    assert bm.num_evictable == 5 and bm.num_free == 6
    assert bm.allocate("c", 2) == [5]           # a never-used page before any eviction
    assert bm.allocate("c", 4) == [2]           # then a's tail page (least recently freed)
    assert bm.lookup_prefix([1, 2, 3, 4, 5, 6]) == [0, 1]
    assert bm.allocate("c", 8) == [1, 0]
    assert bm.lookup_prefix([1, 2, 3, 4, 5, 6]) == []
    assert bm.lookup_prefix([7, 8, 9, 10, 0]) == [3, 4]
    # A hit takes the page out of the LRU: the next eviction skips it.
    bm.match_prefix("d", [7, 8, 0], 2)
    assert bm.allocate("c", 10) == [4]
    with pytest.raises(BlockManagerError, match="out of pages"):
        bm.allocate("c", 12)
    bm.check()


def test_watermark_and_cached_pages_in_admission():
    bm = BlockManager(10, 2)
    _run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")                                 # 2 cached pages, all 10 allocatable
    hit = bm.lookup_prefix([1, 2, 3, 4, 9], 4)
    assert len(hit) == 2
    assert bm.can_admit(20) and not bm.can_admit(21)
    assert bm.can_admit(20, cached_pages=hit)    # the hit pages count once
    assert bm.can_admit(16, 0.2) and not bm.can_admit(18, 0.2)
    bm.allocate("x", 16)                         # the 8 never-used pages: 2 cached left
    assert not bm.can_admit(2, 0.2) and bm.can_admit(2, 0.1)


def test_prefix_caching_disabled():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    _run(bm, "a", [1, 2, 3, 4, 5])
    assert bm.lookup_prefix([1, 2, 3, 4, 5]) == [] and bm.page_hash(0) is None
    bm.free("a")
    assert bm.num_evictable == 0 and bm.num_free == 4


# -- stateful ----------------------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences match, grow (with dead speculative positions past their committed length),
    commit and free. A model of every page's content checks that prefix hits hand out the
    right K/V and that nobody overwrites a page another sequence reads."""
    seqs = Bundle("seqs")
    freed = Bundle("freed")

    @initialize(num_pages=st.integers(3, 14), page_size=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_pages, page_size, caching):
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching)
        self.ps = page_size
        self.live = {}       # seq -> {"tokens": [...], "committed": n}
        self.content = {}    # (page, offset) -> token written there (-1: dead speculative K/V)
        self.next_id = 0
        self.base = [0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1]

    def _write(self, seq, lo, hi, tokens):
        table = self.bm.block_table(seq)
        for pos in range(lo, hi):
            page = table[pos // self.ps]
            # The invariant that makes copy-on-write unnecessary.
            assert self.bm.ref_count(page) == 1 and self.bm.page_hash(page) is None
            self.content[page, pos % self.ps] = tokens[pos] if pos < len(tokens) else -1

    @rule(target=seqs, shared=st.integers(0, 16), suffix=st.lists(st.integers(0, 2), max_size=10))
    def new_seq(self, shared, suffix):
        tokens = self.base[:shared] + suffix or [2]
        seq = self.next_id
        self.next_id += 1
        pages, n = self.bm.match_prefix(seq, tokens, len(tokens) - 1)
        assert n == len(pages) * self.ps <= len(tokens) - 1
        for pos in range(n):                   # a hit serves exactly these tokens' K/V
            assert self.content[pages[pos // self.ps], pos % self.ps] == tokens[pos]
        self.live[seq] = {"tokens": tokens, "committed": n}
        return seq

    @rule(seq=seqs, k=st.integers(1, 6), spec=st.integers(0, 4))
    def advance(self, seq, k, spec):
        if seq not in self.live:
            return
        s = self.live[seq]
        lo = s["committed"]
        hi = min(lo + k, len(s["tokens"]))
        before = (self.bm.num_free, self.bm.block_table(seq))
        if not self.bm.can_allocate(hi + spec, seq):
            with pytest.raises(BlockManagerError, match=f"sequence {seq} needs"):
                self.bm.allocate(seq, hi + spec)
            assert (self.bm.num_free, self.bm.block_table(seq)) == before
            return
        self.bm.allocate(seq, hi + spec)
        self._write(seq, lo, hi + spec, s["tokens"][:hi])   # positions >= hi are dead drafts
        s["committed"] = hi
        self.bm.commit_full_pages(seq, s["tokens"][:hi])

    @rule(target=freed, seq=consumes(seqs))
    def free(self, seq):
        self.bm.free(seq)
        del self.live[seq]
        return seq

    @rule(seq=freed)
    def double_free(self, seq):
        with pytest.raises(BlockManagerError, match="already freed|unknown"):
            self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule()
    def unknown_free(self):
        with pytest.raises(BlockManagerError, match="unknown sequence"):
            self.bm.free(-1)

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check()
        tables = {s: bm.block_table(s) for s in self.live}
        held = {}
        for t in tables.values():
            for p in t:
                held[p] = held.get(p, 0) + 1
        for p in range(bm.num_pages):
            assert bm.ref_count(p) == held.get(p, 0)
        assert bm.num_free + len(held) == bm.num_pages
        assert bm.num_used == len(held) and bm.num_seqs == len(self.live)
        for s, st_ in self.live.items():        # committed K/V intact, shared pages included
            for pos in range(st_["committed"]):
                assert self.content[tables[s][pos // self.ps], pos % self.ps] == st_["tokens"][pos]
        for (parent, toks), p in ((bm._page_key[p], p) for p in bm._page_hash):
            assert tuple(self.content[p, o] for o in range(self.ps)) == toks
        if not self.live:
            assert bm.num_free == bm.num_pages


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
