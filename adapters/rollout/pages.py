"""The KV page pool's bookkeeping (plain Python): which pages are free, who holds each page, and how many pages a
sequence may still claim.

Page 0 is never handed out: the engine's programs write the keys of idle slots and padding there, so no live page
is touched by them. A page held by several sequences (a group's shared prompt pages) is freed when its last holder
lets go. Admission reserves a sequence's worst case up front (``reserve``) while pages are handed out only as
tokens arrive (``take``), so the pages in use track the live tokens and a running sequence never waits for a page.
"""

from __future__ import annotations

from collections.abc import Iterable

TRASH_PAGE = 0
"""The page idle slots and padding write to; never allocated."""


class PagePool:
    """Free list, holder counts and reservations of ``num_pages`` pages of ``page_size`` tokens.

    Args:
        num_pages: pages in the pool, the trash page included (so ``num_pages - 1`` are usable).
        page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is reserved), got {num_pages}.")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, TRASH_PAGE, -1))  # pop() hands out low pages first
        self._holders = [0] * num_pages
        self._reserved = 0
        self.peak_in_use = 0

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def in_use(self) -> int:
        """Pages held by at least one sequence."""
        return self.usable - len(self._free)

    @property
    def available(self) -> int:
        """Pages neither in use nor promised to an admitted sequence."""
        return len(self._free) - self._reserved

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)

    def reserve(self, pages: int) -> bool:
        """Promises ``pages`` future pages if the pool can keep the promise; returns whether it did."""
        if pages > self.available:
            return False
        self._reserved += pages
        return True

    def take(self) -> int:
        """A free page, held once, drawn from the caller's reservation."""
        self._reserved -= 1
        page = self._free.pop()
        self._holders[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return page

    def hold(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a completion sharing its group's prompt pages)."""
        for page in pages:
            self._holders[page] += 1

    def release(self, pages: Iterable[int], unused_reservation: int = 0) -> None:
        """Drops one holder of each page (freeing those left without one) and returns an unused reservation."""
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)
        self._reserved -= unused_reservation


__all__ = ["TRASH_PAGE", "PagePool"]
