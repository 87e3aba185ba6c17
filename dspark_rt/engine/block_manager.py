"""Pages of one paged KV cache: free list, reference counts, per-sequence block tables, and a
prefix cache of full pages keyed by a chained hash of their token ids.

Every page is in exactly one of three states:
  * free       ref 0, no hash          (the free list)
  * cached     ref 0, hashed           (evictable, LRU; reused on a prefix hit, else evicted
                                        when the free list runs dry)
  * used       ref >= 1                (held by ref-count many block tables; may be hashed)
so num_free (= free + cached) + num_used == num_pages at all times.

Sharing invariant (why no copy-on-write is needed): a page is hashed, hence shareable, only when
every one of its page_size positions lies below the committed length of the sequence that
filled it (commit_full_pages), and a sequence only ever writes positions at or beyond its own
committed length (speculative K/V of rejected drafts, the drafter's block scratch, the next
prefill chunk). match_prefix hands out only hashed pages and sets the new sequence's committed
length to their end, so a page that anybody writes has ref 1 and is never hashed.

One instance per cache. Positions of the drafter's cache hold context K/V projected from target
features, which are a function of the token prefix alone, so the same chained hash applies;
see dspark_rt.engine for enable_prefix_caching=False on the drafter ("rebuild" mode).
"""
from collections import OrderedDict

from ..batch import pages_for

__all__ = ["BlockManager", "BlockManagerError"]

_ROOT_HASH = 0x5D5BA2C0  # chain seed of page 0


class BlockManagerError(RuntimeError):
    """Bad use of a BlockManager: exhaustion, double free, unknown sequence."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 name: str = "kv"):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"BlockManager[{name}]: num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"BlockManager[{name}]: page_size must be an int >= 1, got {page_size!r}")
        self.num_pages, self.page_size, self.name = num_pages, page_size, name
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 hashed pages, LRU first
        self._ref = [0] * num_pages
        self._page_hash: dict[int, int] = {}          # hashed page -> chain hash
        self._page_key: dict[int, tuple] = {}         # hashed page -> (parent hash, tokens)
        self._cached: dict[int, int] = {}             # chain hash -> page
        self._tables: dict[object, list[int]] = {}    # seq -> pages, position l in page l // page_size
        self._chain: dict[object, list[int]] = {}     # seq -> chain hashes of its committed full pages
        self._recently_freed: OrderedDict[object, None] = OrderedDict()  # for double-free messages

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def pages_for(self, n_tokens: int) -> int:
        return pages_for(n_tokens, self.page_size)

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id) -> list[int]:
        """A copy of the sequence's pages (position l lives in page [l // page_size])."""
        return list(self._table(seq_id, "block_table"))

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def page_hash(self, page: int):
        """The chain hash of a cached page, None for an unhashed one."""
        return self._page_hash.get(page)

    def _table(self, seq_id, op: str) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            raise BlockManagerError(self._unknown(seq_id, op))
        return table

    def _unknown(self, seq_id, op: str) -> str:
        if seq_id in self._recently_freed:
            return f"BlockManager[{self.name}].{op}: sequence {seq_id!r} was already freed (double free?)"
        return f"BlockManager[{self.name}].{op}: unknown sequence {seq_id!r} ({len(self._tables)} live)"

    def _new_pages(self, seq_id, n_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.pages_for(n_tokens) - have)

    # -- allocation --------------------------------------------------------------------------

    def can_allocate(self, n_tokens: int, seq_id=None) -> bool:
        """Whether allocate(seq_id, n_tokens) would succeed (seq_id None: a new sequence)."""
        need = -(-n_tokens // self.page_size) - len(self._tables.get(seq_id, ()))
        return need <= 0 or need <= len(self._free) + len(self._evictable)  # every round: inline

    def can_admit(self, n_tokens: int, watermark_frac: float = 0.0, cached_pages=()) -> bool:
        """Whether a new sequence that starts with `cached_pages` (from lookup_prefix) and grows
        to n_tokens leaves at least watermark_frac * num_pages pages free afterwards."""
        cached_pages = list(cached_pages)
        revived = sum(1 for p in cached_pages if self._ref[p] == 0)  # leave the evictable pool
        new = max(0, self.pages_for(n_tokens) - len(cached_pages))
        return self.num_free - revived - new >= int(watermark_frac * self.num_pages)

    def allocate(self, seq_id, n_tokens: int) -> list[int]:
        """Grows the sequence's table (created if new) to cover n_tokens positions; returns the
        pages added. Takes free pages first, then evicts cached pages, least recent first."""
        if n_tokens < 0:
            raise ValueError(f"BlockManager[{self.name}].allocate: n_tokens must be >= 0, got {n_tokens}")
        need = self._new_pages(seq_id, n_tokens)
        if need == 0 and seq_id in self._tables:
            return []  # most rounds: the table covers the round already
        if need > self.num_free:
            have = len(self._tables.get(seq_id, ()))
            raise BlockManagerError(
                f"BlockManager[{self.name}].allocate: out of pages: sequence {seq_id!r} needs {need} "
                f"more pages to cover {n_tokens} tokens (holds {have}, page_size {self.page_size}), "
                f"{self.num_free} of {self.num_pages} free")
        table = self._tables.setdefault(seq_id, [])
        self._chain.setdefault(seq_id, [])
        self._recently_freed.pop(seq_id, None)
        added = []
        for _ in range(need):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unhash(page)
            self._ref[page] = 1
            added.append(page)
        table.extend(added)
        return added

    def free(self, seq_id) -> None:
        """Releases every page of the sequence. Hashed pages whose count drops to 0 stay cached;
        the table's tail goes to the LRU end first (tails are the least likely to be shared)."""
        table = self._table(seq_id, "free")
        for page in reversed(table):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._page_hash:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        del self._tables[seq_id], self._chain[seq_id]
        self._recently_freed[seq_id] = None
        if len(self._recently_freed) > 4096:
            self._recently_freed.popitem(last=False)

    # -- prefix cache ------------------------------------------------------------------------

    @staticmethod
    def _hash(parent: int, tokens: tuple) -> int:
        return hash((parent, tokens))

    def _unhash(self, page: int):
        h = self._page_hash.pop(page)
        del self._page_key[page]
        if self._cached.get(h) == page:
            del self._cached[h]

    def lookup_prefix(self, token_ids, max_tokens: int | None = None) -> list[int]:
        """Cached pages holding the longest run of full pages of token_ids[:max_tokens], without
        taking them (no reference counts change)."""
        if not self.enable_prefix_caching:
            return []
        ps = self.page_size
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        pages, parent = [], _ROOT_HASH
        for i in range(limit // ps):
            tokens = tuple(token_ids[i * ps:(i + 1) * ps])
            h = self._hash(parent, tokens)
            page = self._cached.get(h)
            # The stored key guards against hash collisions (tokens and the parent chain hash).
            if page is None or self._page_key[page] != (parent, tokens):
                break
            pages.append(page)
            parent = h
        return pages

    def match_prefix(self, seq_id, token_ids, max_tokens: int | None = None) -> tuple[list[int], int]:
        """Starts a new sequence on the cached full pages of token_ids[:max_tokens] (a reference
        each). Returns (pages, n_cached_tokens); the sequence's committed length is then
        n_cached_tokens and it must write only positions >= n_cached_tokens. Callers that need
        the last token's logits pass max_tokens = len(token_ids) - 1."""
        if seq_id in self._tables:
            raise BlockManagerError(f"BlockManager[{self.name}].match_prefix: sequence {seq_id!r} "
                                    f"already holds {len(self._tables[seq_id])} pages")
        pages = self.lookup_prefix(token_ids, max_tokens)
        for page in pages:
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1
        self._tables[seq_id] = list(pages)
        self._chain[seq_id] = [self._page_hash[p] for p in pages]
        self._recently_freed.pop(seq_id, None)
        return list(pages), len(pages) * self.page_size

    def fills_pages(self, seq_id, n_tokens: int) -> bool:
        """Whether a committed prefix of n_tokens fills a page commit_full_pages has not seen
        (True for an unknown sequence: commit_full_pages then says what is wrong)."""
        chain = self._chain.get(seq_id)
        return chain is None or n_tokens // self.page_size > len(chain)

    def commit_full_pages(self, seq_id, token_ids) -> int:
        """Registers the sequence's pages that are full of committed tokens: token_ids must be
        exactly the committed prefix (positions whose K/V are final; never dead speculative
        positions). Only pages not registered yet are hashed. Returns how many were cached; a
        page whose content is already cached elsewhere stays private (the first copy wins)."""
        if not self.fills_pages(seq_id, len(token_ids)):
            return 0  # most rounds: no page filled since the last call
        table = self._table(seq_id, "commit_full_pages")
        if not self.enable_prefix_caching:
            return 0
        chain, ps = self._chain[seq_id], self.page_size
        n_full = min(len(token_ids) // ps, len(table))
        added = 0
        for i in range(len(chain), n_full):
            parent = chain[-1] if chain else _ROOT_HASH
            tokens = tuple(token_ids[i * ps:(i + 1) * ps])
            h = self._hash(parent, tokens)
            chain.append(h)
            page = table[i]
            if h in self._cached or page in self._page_hash:
                continue
            self._cached[h] = page
            self._page_hash[page] = h
            self._page_key[page] = (parent, tokens)
            added += 1
        return added

    # -- checking ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError if an internal invariant is broken (tests call it every step)."""
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), f"[{self.name}] free list repeats a page"
        assert not free & evict, f"[{self.name}] pages both free and cached: {sorted(free & evict)}"
        held = [0] * self.num_pages
        for seq, table in self._tables.items():
            assert len(set(table)) == len(table), f"[{self.name}] seq {seq!r} repeats a page"
            for p in table:
                held[p] += 1
        for p in range(self.num_pages):
            assert held[p] == self._ref[p], f"[{self.name}] page {p}: ref {self._ref[p]}, in {held[p]} tables"
            state = (p in free) + (p in evict) + (held[p] > 0)
            assert state == 1, f"[{self.name}] page {p} is in {state} of free/cached/used"
        assert all(p in self._page_hash for p in evict), f"[{self.name}] an evictable page has no hash"
        assert not free & set(self._page_hash), f"[{self.name}] a free page is hashed"
        for h, p in self._cached.items():
            assert self._page_hash.get(p) == h, f"[{self.name}] cache entry {h} -> page {p} disagrees"
            parent, tokens = self._page_key[p]
            assert self._hash(parent, tokens) == h and len(tokens) == self.page_size
        assert len(self._cached) == len(self._page_hash) == len(self._page_key)
