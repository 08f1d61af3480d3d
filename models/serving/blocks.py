"""The pages of one attention-DP rank's paged KV cache, on the host: which are free, which hold
whose positions, and which hold a known run of tokens that a later request may reuse.

Every full page is named by a hash of its tokens chained with the hash of the pages before it
(and of the adapter the tokens ran through), so two requests whose prompts share a prefix name
their first pages alike. A page's references count the sequences that hold it; one that no
sequence holds but that has a name stays cached, evicted oldest first when a fresh page is
needed (as vLLM's prefix caching and SGLang's radix cache keep reusable prefixes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


def page_hashes(
    tokens: Sequence[int], page_size: int, pages: int, root: Hashable = None
) -> list[int]:
    """The chained names of the first `pages` full pages of `tokens` (`root` seeds the chain:
    the adapter the tokens run through, None for the base model)."""
    hashes, parent = [], hash(("root", root))
    for index in range(pages):
        block = tuple(tokens[index * page_size : (index + 1) * page_size])
        if len(block) < page_size:
            break
        parent = hash((parent, block))
        hashes.append(parent)
    return hashes


class PagePool:
    """One DP rank's pages: allocation, reference counts and the prefix cache.

    Attributes:
      pages: Pages in the pool.
      reused: Pages found in the cache for a new request so far (what `match` returned).
    """

    def __init__(self, pages: int, *, caching: bool = True):
        if pages < 1:
            raise ValueError(f"a page pool needs at least one page; got {pages=}")
        self.pages = pages
        self.caching = caching
        self.reused = 0
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * pages
        self._name_of: dict[int, int] = {}
        self._page_of: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: oldest first

    @property
    def available(self) -> int:
        """Pages that `allocate` can hand out: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        """Pages some sequence holds."""
        return self.pages - self.available

    @property
    def cached(self) -> int:
        """Named pages (held or idle) a later request may reuse."""
        return len(self._page_of)

    def refs(self, page: int) -> int:
        """The sequences holding `page`."""
        return self._refs[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, each held once, or None (nothing taken) when fewer are available.
        Free pages go first, then idle cached ones, oldest first (their names are forgotten)."""
        if count > self.available:
            return None
        taken = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._name_of.pop(page)]
            self._refs[page] = 1
            taken.append(page)
        return taken

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` name cached pages (nothing is taken)."""
        if not self.caching:
            return 0
        count = 0
        for name in hashes:
            if name not in self._page_of:
                break
            count += 1
        return count

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the leading `hashes`, each now held once more (counted in
        `reused`)."""
        pages = [self._page_of[name] for name in hashes[: self.lookup(hashes)]]
        for page in pages:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
        self.reused += len(pages)
        return pages

    def name(self, page: int, name: int) -> None:
        """Records that held page `page` is full, with tokens named `name`: a later request
        whose prefix has that name may reuse it (unless another page has the name already)."""
        if not self.caching or name in self._page_of or page in self._name_of:
            return
        self._page_of[name] = page
        self._name_of[page] = name

    def release(self, pages: Sequence[int]) -> None:
        """Drops one hold of each page: a page no one holds becomes free, or idle in the cache
        when it has a name."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} is released but not held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._name_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
