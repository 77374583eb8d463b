"""A minimal non-Spyre worker, for testing the generic
MultiprocessingExecutor: it joins a gloo process group and answers a few
questions, nothing more."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from vllm.worker.worker_base import WorkerBase


class PlainCPUWorker(WorkerBase):

    def __init__(self, vllm_config, local_rank, rank, distributed_init_method,
                 is_driver_worker=False):
        super().__init__(vllm_config)
        self.rank = rank
        self.init_method = distributed_init_method
        # Read as the worker is built: the executor sets a rank's variables
        # while it starts (in the engine's process for rank 0, only then).
        self.tag = os.environ.get("PLAIN_RANK_TAG", "")

    def init_device(self) -> None:
        dist.init_process_group(
            "gloo", init_method=self.init_method, rank=self.rank,
            world_size=self.vllm_config.parallel_config.world_size)

    def load_model(self) -> None:
        pass

    def sum_of_ranks(self) -> int:
        t = torch.tensor([self.rank])
        dist.all_reduce(t)
        return int(t.item())

    def rank_tag(self) -> str:
        return self.tag

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
