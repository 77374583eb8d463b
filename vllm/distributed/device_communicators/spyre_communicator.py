"""The tensor-parallel communicator of the Spyre platform.

vLLM's base communicator gathers with ``all_gather_into_tensor``, which
gloo (the CPU process group Spyre's ranks talk over) lacks.  vLLM's own
model code gathers its vocabulary-sharded logits that way on every rank
(``LogitsProcessor`` with ``SpyrePlatform.use_all_gather``), as FMS's
head does: here each rank's shard comes through gloo's list-form
``all_gather`` instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed.device_communicators.base_device_communicator import \
    DeviceCommunicatorBase


class SpyreCommunicator(DeviceCommunicatorBase):
    """vLLM's device communicator with a gloo-compatible ``all_gather``."""

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)
