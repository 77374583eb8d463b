"""SpyreCBWorker: one Spyre card under continuous batching.

The platform installs this worker when ``VLLM_SPYRE_USE_CB=1``.  It differs
from ``SpyreStaticWorker`` in how the key/value cache is sized and when the
model is warmed up:

* ``load_model`` checks that the model and the smallest useful pool fit
  in memory, then loads and compiles the model, nothing more;
* ``determine_num_available_blocks`` sizes the block pool from the memory
  left (vLLM's ``--gpu-memory-utilization`` applied to this machine's
  memory, or its cgroup's limit), capped at what ``--max-num-seqs``
  sequences of ``--max-model-len`` tokens can ever use (one spare block
  each, which vLLM's block manager wants free before a sequence may
  decode); ``--num-gpu-blocks-override`` replaces the result, as on every
  vLLM platform;
* ``initialize_cache`` allocates the pool and then warms up, so the
  compiled graphs see the pool they will serve with.
"""
from __future__ import annotations

import psutil

from vllm.config.spyre import CB_BLOCK_SIZE
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.logger import init_logger
from vllm.spyre_kernels import ops as native
from vllm.worker import spyre_memory
from vllm.worker.spyre_cb_model_runner import SpyreCBModelRunner
from vllm.worker.spyre_worker_base import SpyreWorkerBase

logger = init_logger(__name__)


class SpyreCBWorker(SpyreWorkerBase):
    """Executes continuous batching on one Spyre card (or the CPU)."""

    model_runner: SpyreCBModelRunner  # type: ignore[assignment]
    runner_cls = SpyreCBModelRunner

    def load_model(self) -> None:
        """Checks that the model and the smallest useful pool fit, loads
        and compiles the model; warm-up waits for the pool."""
        self.check_memory()
        self.load_weights()

    def memory_estimate(self) -> spyre_memory.Estimate:
        """Continuous batching: the blocks of one ``max_model_len``
        sequence (the pool then takes what memory is left), or the pool
        ``--num-gpu-blocks-override`` asks for."""
        weights, geometry = self._memory_parts()
        override = self.cache_config.num_gpu_blocks_override
        max_model_len = self.scheduler_config.max_model_len
        blocks = override or blocks_needed(max_model_len, CB_BLOCK_SIZE)
        backend = self.spyre_config.dynamo_backend
        on_kernel = native.in_use(backend,
                                  self.spyre_config.native_kernels)[0]
        return spyre_memory.cb_estimate(
            spyre_memory.process_rss(), weights, geometry, blocks,
            CB_BLOCK_SIZE, max_model_len, self.scheduler_config.max_num_seqs,
            backend, override is not None, on_kernel)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """Blocks that fit this rank's share of the memory vLLM may use,
        at most what the scheduler can ever hold at once; no host blocks
        (preempted sequences are recomputed)."""
        block_bytes = self.model_runner.block_bytes()
        memory = psutil.virtual_memory()
        util = self.cache_config.gpu_memory_utilization
        # Like vLLM on a GPU: a fraction of all memory (the cgroup's limit
        # where lower), less what is in use.
        budget = spyre_memory.memory_limit() * util - (memory.total -
                                                      memory.available)
        budget /= self.parallel_config.world_size  # ranks share the machine
        # A hybrid model's Mamba-2 state slots come first.
        budget -= self.model_runner.state_bytes()
        # With speculative decoding a sequence also holds the lookahead
        # slots of its proposals.
        per_seq = blocks_needed(
            self.scheduler_config.max_model_len +
            self.scheduler_config.num_lookahead_slots, CB_BLOCK_SIZE)
        # vLLM's block manager lets a sequence decode only while a block is
        # free for it (the block it writes into counts as touched), so a
        # full batch of full-length sequences needs one spare block each;
        # without them it preempts at every step.
        useful = self.scheduler_config.max_num_seqs * (per_seq + 1)
        blocks = min(int(budget // block_bytes), useful)
        logger.info(
            "Spyre key/value pool: %d blocks of %d tokens, %.2f MiB each "
            "(memory allows %d, %d sequences of max_model_len=%d need %d)",
            blocks, CB_BLOCK_SIZE, block_bytes / 2**20,
            int(budget // block_bytes), self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_model_len, useful)
        if blocks < per_seq:
            raise ValueError(
                f"The key/value pool needs at least {per_seq} blocks of "
                f"{CB_BLOCK_SIZE} tokens ({per_seq * block_bytes / 2**20:.0f}"
                f" MiB) to hold one sequence of max_model_len="
                f"{self.scheduler_config.max_model_len}, but only "
                f"{max(blocks, 0)} fit in the memory left at "
                f"--gpu-memory-utilization {util}. Lower --max-model-len or "
                "free memory.")
        return blocks, 0

    def initialize_cache(self, num_gpu_blocks: int,
                         num_cpu_blocks: int) -> None:
        """Allocates the block pool, then compiles both graphs on it."""
        if num_gpu_blocks <= 0 or num_cpu_blocks != 0:
            raise ValueError(
                f"Spyre continuous batching needs a positive number of "
                f"device blocks and no host blocks, got {num_gpu_blocks} "
                f"and {num_cpu_blocks}.")
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.model_runner.allocate_pool(num_gpu_blocks)
        self.warm_up()

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.block_bytes()
