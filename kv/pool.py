"""The page allocator: a free list over a fixed number of page ids.

Page 0 is the null page: it pads block tables and is never handed out. This is the one place
a KV page is allocated or freed; every other module goes through :class:`PagePool`.

Why not vLLM's ``KVCacheManager``: its constructor changes every release and its
sliding-window null holes assume causal windowing; the bookkeeping needed here is a free list
and a count, which is smaller than the adapter it would take.
"""

from __future__ import annotations


class CapacityError(RuntimeError):
    """No room: every page, cross-attention slot or session slot is in use.

    The one capacity error of the project: the cache raises it at admission, the engine when no
    session can be evicted, and the server turns it into a "server at capacity" error frame."""


class PagePool:
    """O(1) allocate/free of page ids ``1 .. num_pages - 1`` with exact accounting."""

    NULL_PAGE = 0

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs the null page plus at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        # A stack popped from the end; reversed so that a fresh pool hands out 1, 2, 3, ...
        # (contiguous runs keep the gather path cheap).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._allocated = bytearray(num_pages)  # 1 where a page is handed out: catches double frees

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise CapacityError(f"KV page pool exhausted: need {n} pages, {len(self._free)} of {self.capacity} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._allocated[page] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Freeing a page that is not allocated is a bug: raise."""
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"KV pages freed twice in one call: {sorted(pages)}")
        for page in pages:
            if page <= self.NULL_PAGE or page >= self.num_pages or not self._allocated[page]:
                raise RuntimeError(f"KV page {page} freed but not allocated (double free or foreign page)")
        for page in pages:
            self._allocated[page] = 0
            self._free.append(page)
