"""The KV page pool's bookkeeping (plain Python): which pages are free and who holds each page; and how many pages
fit in a share of a device's memory.

Page 0 is never handed out: the engine's programs write the keys of idle slots and padding there, so no live page
is touched by them. A page held by several sequences (a group's shared prompt pages) is freed when its last holder
lets go. Nothing is reserved ahead: the scheduler takes a page when a token is about to be written to it (with async
scheduling, by the decode call dispatched before the host read the last one: a completion that ended in that one
frees it on the read), and makes room (by preempting a completion) before it takes more pages than are free.
"""

from __future__ import annotations

from collections.abc import Iterable

TRASH_PAGE = 0
"""The page idle slots and padding write to; never allocated."""


class PagePool:
    """Free list and holder counts of ``num_pages`` pages of ``page_size`` tokens.

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
    def free(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)

    def take(self) -> int:
        """A free page, held once."""
        if not self._free:
            raise RuntimeError("the page pool has no free page: the scheduler must make room before taking one; "
                               "this is a bug.")
        page = self._free.pop()
        self._holders[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return page

    def hold(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a completion sharing its group's prompt pages)."""
        for page in pages:
            self._holders[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drops one holder of each page, freeing those left without one."""
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)


def pages_within_memory(bytes_limit: int, bytes_in_use: int, fraction: float, bytes_per_token: int,
                        page_size: int) -> int:
    """The usable pages of a pool that fits in ``fraction`` of a device's memory beside what is already in use
    (vLLM's ``gpu_memory_utilization``): ``floor((fraction * bytes_limit - bytes_in_use) / (bytes_per_token *
    page_size)) - 1``, the trash page being the one taken off.

    Args:
        bytes_limit: the device's memory (``memory_stats()["bytes_limit"]``).
        bytes_in_use: bytes already held there (weights, optimizer state...; ``memory_stats()["bytes_in_use"]``).
        fraction: the share of ``bytes_limit`` the process may hold in all, pool included, in ``(0, 1]``.
        bytes_per_token: keys and values of one token over every layer.
        page_size: tokens per page.

    Raises:
        ValueError: the share leaves no room for a pool of two pages (the message gives the numbers).
    """
    room = int(fraction * bytes_limit) - bytes_in_use
    page_bytes = bytes_per_token * page_size
    pages = room // page_bytes - 1 if room > 0 else 0
    if pages < 1:
        raise ValueError(
            f"gpu_memory_utilization={fraction} of the device's {bytes_limit} bytes leaves {max(room, 0)} bytes "
            f"beside the {bytes_in_use} in use, less than the two pages of {page_bytes} bytes a KV pool needs; raise "
            "gpu_memory_utilization, free device memory, or give kv_cache_tokens instead.")
    return pages


__all__ = ["TRASH_PAGE", "PagePool", "pages_within_memory"]
