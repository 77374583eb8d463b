"""Large buffers and glibc's malloc: where a worker's big tensors live.

glibc maps every allocation above its mmap threshold separately and unmaps
it when freed.  A worker changes that twice, unless the user has tuned the
threshold (``malloc_threshold_unset``): during the model's load it returns
every large buffer to the system as it is freed (``return_large_buffers``),
so the float32 tensors a load reads and replaces do not stay behind as
heap; once loaded, it keeps large buffers in the heap from pass to pass
(``keep_large_buffers``), so no step faults its activations in anew.
``SpyreWorkerBase.load_weights`` calls both; the memory check
(``spyre_memory``) counts the peak a pass holds.

Python's own heap: once warm-up has compiled every graph, the worker
moves the objects start-up made (about a million with ``inductor``: the
traced graphs, their guards and kernels) out of the collector's reach
(``freeze_start_up_objects``), as vLLM's API server does in its own
process.  Otherwise each full collection while serving walks them all,
0.6 s or more between two steps.
"""
from __future__ import annotations

import gc
import os
from typing import Mapping, Optional


def malloc_threshold_unset(
        environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when the user has not tuned glibc's mmap threshold
    (``MALLOC_MMAP_THRESHOLD_``, or ``mmap_threshold`` in
    ``GLIBC_TUNABLES``); see ``keep_large_buffers``."""
    env = os.environ if environ is None else environ
    return "MALLOC_MMAP_THRESHOLD_" not in env and \
        "mmap_threshold" not in env.get("GLIBC_TUNABLES", "")


#: glibc's mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations up to this size come from the heap once large buffers are
#: kept there (the most mallopt accepts as an int).
HEAP_THRESHOLD = 2**31 - 1


#: Allocations from this size on get mappings of their own during the load.
LOAD_THRESHOLD = 2**20


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt``; False where the C library is not glibc."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc
    return bool(mallopt(param, value))


def return_large_buffers(threshold_unset: bool) -> bool:
    """Returns every buffer of ``LOAD_THRESHOLD`` or more to the system
    when it is freed, for the load: each tensor as read and each layer's
    weight before it is packed are freed as the load goes, and glibc's
    own threshold, which rises to the size of the buffers freed (up to
    32 MiB), would leave them behind as free heap that the model's
    tensors never reuse.  Only on glibc, and only when the user has not
    tuned the threshold; returns whether it was done."""
    return threshold_unset and _mallopt(_M_MMAP_THRESHOLD, LOAD_THRESHOLD)


def keep_large_buffers(threshold_unset: bool) -> bool:
    """Serves large tensors from the heap, reused from pass to pass.

    glibc gives every allocation above its mmap threshold (at most 32 MiB
    unless set) a mapping of its own and returns it to the system on free,
    so each pass of a large shape faults in, zeroes and unmaps its big
    activations anew: a 256-token, 32-text pass of all-MiniLM spent about
    a quarter of its time there (benchmarks/embeddings.py, docs/
    embeddings.md).  Raising the mmap and trim thresholds keeps those
    buffers in the heap, where the next pass finds them; the memory held
    is the peak of a pass, which the start-up check already counts.  Only
    on glibc, and only when the user has not tuned the threshold
    (``threshold_unset``); returns whether it was done."""
    if not threshold_unset:
        return False
    return _mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD) and \
        _mallopt(_M_TRIM_THRESHOLD, HEAP_THRESHOLD)


def freeze_start_up_objects() -> int:
    """Collects once, then leaves every object alive now to the permanent
    generation, which no later collection walks; the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
