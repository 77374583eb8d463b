"""SpyreSpecWorker: continuous batching with speculative decoding.

The platform installs this worker when ``VLLM_SPYRE_USE_CB=1`` and
``--speculative-config`` are both set.  It is ``SpyreCBWorker`` (the pool
sized for each sequence's lookahead slots too, and a block of the draft
model's pool with each of the served model's) with the runner that
verifies proposals, ``SpyreSpecModelRunner``; the driver worker's
process holds a draft model or an MLP speculator whole (also under tensor
parallelism), and its up-front memory check counts their weights.
"""
from __future__ import annotations

from vllm.config import VllmConfig
from vllm.worker.spyre_cb_worker import SpyreCBWorker
from vllm.worker.spyre_one_rank import draft_vllm_config
from vllm.worker.spyre_spec_model_runner import SpyreSpecModelRunner


class SpyreSpecWorker(SpyreCBWorker):
    """Continuous batching whose decode steps verify proposals."""

    model_runner: SpyreSpecModelRunner  # type: ignore[assignment]
    runner_cls = SpyreSpecModelRunner

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A draft model or MLP speculator runs where the steps are built.
        self.model_runner.proposes = self.is_driver_worker

    def weighed_configs(self) -> tuple[VllmConfig, ...]:
        spec = self.vllm_config.speculative_config
        if (spec is None or spec.method == "ngram"
                or not self.is_driver_worker):
            return super().weighed_configs()
        return (self.vllm_config, draft_vllm_config(self.vllm_config))
