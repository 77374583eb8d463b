"""SpyreWorkerBase: what the static, continuous-batching and pooling
workers share.

Start-up runs in named phases: ``init_device`` (threads, gloo process
group), ``load_model`` (check that the configuration fits in memory, load
the model, compile it, then warm up so that serving compiles nothing) and
the cache phase, which each mode sizes its own way.  Each engine step
arrives at ``execute_model`` (upstream's ``LocalOrDistributedWorkerBase``),
which hands the batch to the mode's model runner.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.config.spyre_model_facts import FMS, SpyreModelFacts
from vllm.distributed import (ensure_model_parallel_initialized,
                              init_distributed_environment)
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.model_executor import set_random_seed
from vllm.model_executor.models.spyre_dtypes import (load_dtype,
                                                     precision_of,
                                                     reads_linears_narrow,
                                                     stored_dtypes)
from vllm.platforms import current_platform
from vllm.sequence import ExecuteModelRequest
from vllm.spyre_kernels import ops as native
from vllm.worker import (spyre_heap, spyre_image_memory, spyre_lora_memory,
                         spyre_memory)
from vllm.worker.spyre_runner_base import SpyreRunnerBase
from vllm.worker.worker_base import (LocalOrDistributedWorkerBase, WorkerBase,
                                     WorkerInput)

logger = init_logger(__name__)


class SpyreWorkerBase(LocalOrDistributedWorkerBase):
    """What every Spyre worker does the same way: settings, threads, the
    process group, the memory check, the load and warm-up phases, weight
    updates and the start-up reports.  A subclass names its runner
    (``runner_cls``) and says what its mode holds in memory
    (``memory_estimate``) and how its cache is sized."""

    model_runner: SpyreRunnerBase
    #: The model runner class of the worker's mode.
    runner_cls: type

    def __init__(self,
                 vllm_config: VllmConfig,
                 local_rank: int,
                 rank: int,
                 distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        WorkerBase.__init__(self, vllm_config=vllm_config)
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.spyre_config = SpyreConfig.from_vllm_config(vllm_config)
        if self.speculative_config is not None and \
                not self.runner_cls.speculates:
            raise NotImplementedError(
                f"{type(self).__name__} does not run speculative decoding; "
                "it runs under continuous batching (VLLM_SPYRE_USE_CB=1)")
        self.model_runner = self.runner_cls(vllm_config, self.spyre_config)

    def init_device(self) -> None:
        """Sets intra-op threads and joins the gloo process group."""
        threads = _default_threads()
        torch.set_num_threads(threads)
        logger.info("Spyre worker %d: %d intra-op threads", self.rank,
                    threads)
        init_distributed_environment(
            world_size=self.parallel_config.world_size,
            rank=self.rank,
            local_rank=self.local_rank,
            distributed_init_method=self.distributed_init_method,
            backend=current_platform.dist_backend,
        )
        ensure_model_parallel_initialized(
            self.parallel_config.tensor_parallel_size,
            self.parallel_config.pipeline_parallel_size)
        set_random_seed(self.model_config.seed)

    def load_model(self) -> None:
        """Checks that the configuration fits in memory, loads and compiles
        the model, then warms up every shape."""
        self.check_memory()
        self.load_weights()
        self.warm_up()

    def warm_up(self) -> None:
        """The runner's warm-up (every graph serving will use), then the
        objects start-up made frozen out of the collector's reach
        (``spyre_heap.freeze_start_up_objects``)."""
        self.model_runner.warmup()
        spyre_heap.freeze_start_up_objects()

    def load_weights(self) -> None:
        """Loads and compiles the model, its transient buffers (each
        tensor as read, each layer's weight before it is packed) given
        back to the system as they are freed (``return_large_buffers``),
        then keeps the large buffers of the passes to come in the heap
        (``keep_large_buffers``)."""
        spyre_heap.return_large_buffers(spyre_heap.malloc_threshold_unset())
        self.model_runner.load_model()
        if spyre_heap.keep_large_buffers(spyre_heap.malloc_threshold_unset()):
            logger.info("Spyre worker %d: large buffers stay in the heap "
                        "between passes (glibc mmap threshold %d MiB)",
                        self.rank, spyre_heap.HEAP_THRESHOLD >> 20)

    def check_memory(self) -> None:
        """``ValueError`` before anything is loaded when this rank's
        estimated memory does not fit its share (``spyre_memory``)."""
        estimate = spyre_image_memory.with_images(
            self.memory_estimate(), self.vllm_config,
            torch.empty((), dtype=self.held_dtype()).element_size())
        #: Kept for ``benchmarks/memory.py`` (``collective_rpc``).
        self.startup_memory_estimate = estimate
        limit = spyre_memory.memory_limit()
        ranks = spyre_memory.ranks_on_this_machine(
            self.parallel_config.world_size)
        util = self.cache_config.gpu_memory_utilization
        logger.info(
            "Spyre memory check: rank %d needs about %s, sized for %s; "
            "%.2f GiB available to each of %d rank(s) on this machine",
            self.rank, estimate.describe(), estimate.sized_for,
            limit * util / ranks / spyre_memory.GiB, ranks)
        spyre_memory.check(estimate, limit, util, ranks)

    def get_memory_estimate(self) -> spyre_memory.Estimate:
        """The estimate ``check_memory`` made at start-up."""
        return self.startup_memory_estimate

    def memory_estimate(self) -> spyre_memory.Estimate:
        """What this rank will hold in memory, in the worker's mode."""
        raise NotImplementedError

    def held_dtype(self) -> torch.dtype:
        """The dtype the model's own tensors are held in."""
        return precision_of(self.model_config.dtype,
                            self.spyre_config.dynamo_backend).model

    def _memory_parts(self) -> tuple[int, spyre_memory.Geometry]:
        """This rank's weight bytes (LoRA adapters' included) and cache
        geometry, at the dtypes held.
        bfloat16 on the CPU holds the cache and the linear layers' weights
        in bfloat16 and the rest in float32; the linear weights are
        counted at two bytes where they are read so (``spyre_dtypes.
        load_dtype``, FMS's model code), else at float32 (an upper bound:
        the float32 copy is replaced by the packed one, and its memory
        given back)."""
        precision = precision_of(self.model_config.dtype,
                                 self.spyre_config.dynamo_backend)
        item = torch.empty((), dtype=precision.model).element_size()
        kv_item = torch.empty((), dtype=precision.kv).element_size()
        matrix_item = (torch.empty((), dtype=precision.linear).element_size()
                       if self.reads_linears_narrow() else None)
        geometry = spyre_memory.geometry_of(self.vllm_config, item, kv_item)
        weights = sum(spyre_memory.weights_of(config, item, matrix_item)
                      for config in self.weighed_configs())
        lora = spyre_lora_memory.lora_bytes(geometry, self.lora_config)
        return weights + lora, geometry

    def weighed_configs(self) -> tuple[VllmConfig, ...]:
        """The configs of the models this rank holds the weights of."""
        return (self.vllm_config, )

    def reads_linears_narrow(self) -> bool:
        """Whether the checkpoint's linear weights are held in a narrower
        dtype than the model's own tensors from the read on (FMS's model
        code, bfloat16 served on the CPU: read so from a bfloat16
        checkpoint, converted as read from a float32 one where the kernels
        pack them), so that no float32 copy of them is ever made."""
        facts = SpyreModelFacts.from_vllm_config(self.vllm_config)
        if facts.model_impl != FMS:
            return False
        backend = self.spyre_config.dynamo_backend
        precision = precision_of(self.model_config.dtype, backend)
        stored = stored_dtypes(self.model_config.model)
        # Only asked (the kernels built, if need be) where it decides.
        packed = load_dtype(precision, stored) != precision.linear and \
            native.in_use(backend, self.spyre_config.native_kernels)[0]
        return reads_linears_narrow(
            precision, stored, self.parallel_config.tensor_parallel_size,
            packed)

    def get_startup_timings(self) -> dict[str, float]:
        """Seconds per start-up phase (model load, warm-up of each shape)."""
        return dict(self.model_runner.startup_timings)

    def get_graph_cache_stats(self) -> dict[str, int]:
        """Graphs this rank loaded from the graph cache, compiled, and
        rejected (a corrupt, foreign or stale file); empty when the cache
        is off."""
        model = self.model_runner.model
        return model.graph_cache_stats() if model is not None else {}

    def update_weights_in_place(self, state_dict) -> dict:
        """Loads new weights into the compiled model, nothing recompiled:
        ``state_dict`` maps Hugging Face names to the full tensors of the
        checkpoint the model was loaded from (each rank keeps its shard).
        Called on every rank by ``LLM.collective_rpc`` between requests; a
        mismatching state dict is refused with a ``ValueError`` naming the
        tensors, and the old weights stay.  Returns the tensors loaded and
        the seconds taken."""
        model = self.model_runner.model
        if model is None:
            raise RuntimeError("update_weights_in_place before load_model")
        start = time.perf_counter()
        count = model.update_weights_in_place(state_dict)
        seconds = time.perf_counter() - start
        logger.info("Spyre worker %d: loaded %d tensors in place in %.2f s",
                    self.rank, count, seconds)
        return {"tensors": count, "seconds": seconds}

    # ---- LoRA adapters (``--enable-lora``; ``vllm.lora.spyre_lora``) ----
    def _lora(self):
        model = self.model_runner.model
        lora = getattr(model, "lora", None)
        if lora is None:
            raise ValueError("LoRA is not enabled: start with --enable-lora "
                             "(and --model-impl vllm)")
        return lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().list()

    @property
    def do_metadata_broadcast(self) -> bool:
        return self.parallel_config.world_size > 1

    @property
    def kv_cache(self) -> Optional[list[list[torch.Tensor]]]:
        return None

    def prepare_worker_input(
            self, execute_model_req: ExecuteModelRequest) -> WorkerInput:
        return WorkerInput(
            num_seq_groups=len(execute_model_req.seq_group_metadata_list))

    def execute_worker(self, worker_input: WorkerInput) -> None:
        """No cache swaps or copies: preempted sequences are recomputed."""


def _default_threads() -> int:
    """Intra-op threads: OMP_NUM_THREADS if set, else every usable core."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, len(os.sched_getaffinity(0)))
