"""SpyrePoolingWorker: one Spyre card serving a pooling model (embeddings,
cross-encoder scores).

The platform installs this worker when vLLM runs a model with the pooling
runner (``task="embed"``, ``"score"``, ``"classify"``).  Start-up is
``SpyreWorkerBase``'s (memory check, load, compile, warm-up of every shape);
the difference is what is sized: a pooling model keeps no key/value cache
(vLLM's engine never asks a pooling worker for blocks), so the memory
check counts the weights and the largest shape's activations only.
"""
from __future__ import annotations

import torch

from vllm.model_executor.models.spyre_dtypes import encoder_dtype
from vllm.worker import spyre_memory
from vllm.worker.spyre_pooling_model_runner import SpyrePoolingModelRunner
from vllm.worker.spyre_worker_base import SpyreWorkerBase


class SpyrePoolingWorker(SpyreWorkerBase):
    """Executes a pooling model on one Spyre card (or the CPU)."""

    model_runner: SpyrePoolingModelRunner  # type: ignore[assignment]
    runner_cls = SpyrePoolingModelRunner

    def held_dtype(self) -> torch.dtype:
        """float32 under ``--dtype bfloat16`` on the CPU: only the
        products run in bfloat16 (``encoder_dtype``)."""
        return encoder_dtype(self.model_config.dtype,
                             self.spyre_config.dynamo_backend)[0]

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """Never asked: vLLM's V0 engine skips the cache phase for pooling
        models, which keep no key/value cache."""
        raise NotImplementedError(
            "Pooling models keep no key/value cache on Spyre")

    def reads_linears_narrow(self) -> bool:
        """An encoder is read in the dtype its tensors are held in
        (``encoder_dtype``), its bfloat16 products made from that."""
        return False

    def memory_estimate(self) -> spyre_memory.Estimate:
        """The weights and the largest shape's activations; no cache."""
        weights, geometry = self._memory_parts()
        return spyre_memory.pooling_estimate(
            spyre_memory.process_rss(), weights, geometry,
            self.spyre_config.warmup_shapes, self.spyre_config.dynamo_backend)
