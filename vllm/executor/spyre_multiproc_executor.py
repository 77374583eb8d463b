"""MultiprocessingSpyreExecutor: tensor parallelism over several Spyre cards
on one machine, one worker process per card.

It is the generic ``MultiprocessingExecutor`` with the Spyre hooks of
``SpyreExecutorMixin``; every rank loads its shard of the FMS model
(``distributed_strategy="tp"``), compiles and warms up the same shapes, and
follows the driver's steps through the gloo process group.
"""
from __future__ import annotations

from vllm.executor.spyre_multiproc_executor_base import (
    MultiprocessingExecutor)
from vllm.executor.spyre_executor import SpyreExecutorMixin


class MultiprocessingSpyreExecutor(SpyreExecutorMixin,
                                   MultiprocessingExecutor):
    """Several Spyre cards, one process each, on one machine."""
