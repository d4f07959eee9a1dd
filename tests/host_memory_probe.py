"""Run as a script: imports torchlike (which tunes glibc's malloc, adapters.runtime.host_memory), then, from a thread
other than the main one (as XLA's runtime threads allocate), allocates a 64 MiB block, frees it and allocates it again.
Prints a JSON line with the allocator status and what glibc's ``mallinfo2`` counters showed: bytes served by
``mmap`` while the block was held, the main arena's free bytes after the free (the block kept), and whether the second
allocation reused the first's address. These are the allocator's bookkeeping, not timings or page-fault counts, so
they do not depend on the machine's load (``benchmarks/host_memory.py`` measures the page faults this saves)."""

import ctypes
import json
import threading

import torchlike  # noqa: F401  (before JAX starts, as a user's script does)
from torchlike.adapters.runtime import host_memory

BLOCK = 64 * 1024**2


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
result: dict = {"status": host_memory.status}


def allocate_twice() -> None:
    before = libc.mallinfo2()
    first = libc.malloc(BLOCK)
    ctypes.memset(first, 1, BLOCK)
    held = libc.mallinfo2()
    libc.free(first)
    freed = libc.mallinfo2()
    second = libc.malloc(BLOCK)
    libc.free(second)
    # Kept after the free: the main arena holds at least the block's bytes free (how much it grew, or how much its free
    # bytes grew, depends on what it held before: the block may take free space at its top and its free may trim some).
    result.update(mmapped_while_held=held.hblkhd - before.hblkhd, main_arena_kept_after_free=freed.fordblks,
                  address_reused=first == second)


thread = threading.Thread(target=allocate_twice)
thread.start()
thread.join()
print(json.dumps(result))
