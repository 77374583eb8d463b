"""SpyreSpecWorker: continuous batching with speculative decoding.

The platform installs this worker when ``VLLM_SPYRE_USE_CB=1`` and
``--speculative-config`` are both set.  It is ``SpyreCBWorker`` (the pool
sized for each sequence's lookahead slots too) with the runner that
verifies proposals, ``SpyreSpecModelRunner``.
"""
from __future__ import annotations

from vllm.worker.spyre_cb_worker import SpyreCBWorker
from vllm.worker.spyre_spec_model_runner import SpyreSpecModelRunner


class SpyreSpecWorker(SpyreCBWorker):
    """Continuous batching whose decode steps verify proposals."""

    model_runner: SpyreSpecModelRunner  # type: ignore[assignment]
    runner_cls = SpyreSpecModelRunner
