"""How much memory a call takes at once, for tests that a function reads a large, memory-mapped array
in chunks instead of copying it whole: the largest block any torch op allocates on the CPU (torch's
profiler records each op's allocations), and the peak of what numpy allocates (numpy reports its
arrays to tracemalloc)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.profiler import ProfilerActivity, profile


def largest_allocation(call: Callable[[], Any]) -> int:
    """Bytes of the largest CPU allocation of any torch op while ``call()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        call()
    return max((event.cpu_memory_usage for event in recorded.events()), default=0)


def peak_traced(call: Callable[[], Any]) -> int:
    """Peak bytes that Python and numpy allocate at once while ``call()`` runs, above what was there."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def memory_mapped(array: np.ndarray, path: Path) -> np.ndarray:
    """``array`` saved at ``path`` and opened read-only as a memory map."""
    np.save(path, array)
    return np.load(path, mmap_mode="r")
