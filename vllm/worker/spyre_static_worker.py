"""SpyreStaticWorker: one Spyre card under static batching, driven by the
executor.

Start-up and steps are ``SpyreWorkerBase``'s; the warm-up compiles every
configured shape.  There is no paging in static batching: the KV cache of
a batch lives inside the model, one "block" per sequence, and the worker
reports ``max_num_seqs + 1`` blocks of ``max_model_len`` tokens, as vLLM's
V0 Neuron worker does.
"""
from __future__ import annotations

from vllm.worker import spyre_memory
from vllm.worker.spyre_static_model_runner import SpyreStaticModelRunner
from vllm.worker.spyre_worker_base import SpyreWorkerBase


class SpyreStaticWorker(SpyreWorkerBase):
    """Executes static batching on one Spyre card (or the CPU stand-in)."""

    model_runner: SpyreStaticModelRunner
    runner_cls = SpyreStaticModelRunner

    def memory_estimate(self) -> spyre_memory.Estimate:
        """Static batching: a cache per warm-up shape."""
        weights, geometry = self._memory_parts()
        return spyre_memory.static_estimate(
            spyre_memory.process_rss(), weights, geometry,
            self.spyre_config.warmup_shapes,
            self.spyre_config.dynamo_backend)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """One block per sequence, ``max_num_seqs`` sequences, one spare."""
        return self.scheduler_config.max_num_seqs + 1, 0

    def initialize_cache(self, num_gpu_blocks: int,
                         num_cpu_blocks: int) -> None:
        """Checks the one-block-per-sequence contract; the KV cache itself
        belongs to the model runner."""
        expected = self.scheduler_config.max_num_seqs + 1
        if num_gpu_blocks != expected or num_cpu_blocks != 0:
            raise ValueError(
                f"Spyre holds one KV block per sequence: expected "
                f"{expected} device blocks and 0 host blocks, got "
                f"{num_gpu_blocks} and {num_cpu_blocks}.")
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks

    def get_cache_block_size_bytes(self) -> int:
        raise NotImplementedError(
            "KV cache block sizes are not defined on Spyre (no paging)")
