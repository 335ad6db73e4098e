"""Touch memory once before timed runs.

On this VM the host backs a guest page only at its first touch: fresh memory fills at about
0.3 GB/s until each page has been touched once, later at several GB/s. Whichever mode runs
first would pay that alone. Allocating and writing the working size once, then freeing it,
leaves the guest's free pages backed, so every timed mode starts alike.
"""

from __future__ import annotations

import time

GIB = 1 << 30


def touch(nbytes: int) -> float:
    """Allocate ``nbytes``, write every page, free it; returns the seconds it took."""
    import torch

    from stageload import return_memory_to_os

    start = time.perf_counter()
    block = torch.empty(int(nbytes), dtype=torch.uint8)
    block.fill_(1)
    del block
    return_memory_to_os(collect=False)
    return time.perf_counter() - start
