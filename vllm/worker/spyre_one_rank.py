"""A speculative proposer's model built and run whole in one process of a
tensor-parallel engine: its config (``draft_vllm_config``) and vLLM's
tensor-parallel group while it is built and runs (``one_rank``).

A speculative proposer (a draft model, an MLP speculator) runs in the
driver worker's process only, while the other ranks wait for the step it
proposes for.  vLLM's parallel layers ask the tensor-parallel group
(``parallel_state.get_tp_group()``) how much of each weight this rank
holds when they are built, and some of them gather over it as they run
(the logits of a vocabulary split over the ranks).  Inside ``one_rank()``
that group is one of this process alone: layers built there hold their
weights whole, and no collective they call waits on another rank.  The
group stays the same object from call to call, so that a graph compiled
inside it keeps its guards.

FMS's model code reads the number of ranks from the model's config
instead (``parallel_config.tensor_parallel_size``); a proposer's config
says one.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

from vllm.config import VllmConfig
from vllm.config.spyre_model_facts import SpyreModelFacts
from vllm.distributed import parallel_state
from vllm.distributed.parallel_state import GroupCoordinator

_ALONE: Optional[GroupCoordinator] = None


def draft_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
    """The served config with the speculative config's model (a draft
    model, an MLP speculator) in the model's place, on one rank, without
    LoRA, its layers named apart from the served model's; a draft model's
    model code and window as the platform chose them."""
    spec = vllm_config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    draft = copy.copy(vllm_config)
    draft.model_config = spec.draft_model_config
    draft.lora_config = None
    parallel = copy.copy(vllm_config.parallel_config)
    parallel.tensor_parallel_size = 1
    parallel.world_size = parallel.pipeline_parallel_size
    draft.parallel_config = parallel
    # Its attention layers register under the same names as the served
    # model's: in a forward context of their own.
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}
    draft.compilation_config = compilation
    extra = dict(vllm_config.additional_config or {})
    extra[SpyreModelFacts.KEY] = extra.get(SpyreModelFacts.DRAFT_KEY, {})
    draft.additional_config = extra
    return draft


def _alone() -> GroupCoordinator:
    """A tensor-parallel group of this process only: each of its
    collectives returns its input (vLLM's ``GroupCoordinator`` does so for
    a group of one rank)."""
    global _ALONE
    if _ALONE is None:
        group = object.__new__(GroupCoordinator)
        group.unique_name = "spyre_one_rank"
        group.rank = group.local_rank = group.rank_in_group = 0
        group.ranks = [0]
        group.world_size = 1
        group.cpu_group = group.device_group = None
        group.use_device_communicator = False
        group.device_communicator = None
        group.mq_broadcaster = None
        group.use_custom_op_call = False
        group.use_cpu_custom_send_recv = False
        _ALONE = group
    return _ALONE


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """vLLM's tensor-parallel group as one of this process alone, while
    inside."""
    saved = parallel_state._TP
    parallel_state._TP = _alone()
    try:
        yield
    finally:
        parallel_state._TP = saved
