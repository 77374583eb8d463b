"""Loading an FMS decoder for Spyre from a Hugging Face folder.

``load_fms_decoder`` builds the model with FMS's ``get_model`` from the
arguments the family table gives (``spyre_families.fms_model_args``: FMS's
own mapping of ``config.json`` with the family's corrections and checkpoint
adapter), shards it over the tensor-parallel group, runs the family's
``prepare`` step (Mixtral's dense experts) and freezes it for inference.
``SpyreCausalLM`` then swaps in the CPU kernels and compiles it.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.models import spyre_families

logger = init_logger(__name__)


def load_fms_decoder(path: str, hf_config, dtype: torch.dtype, tp_size: int,
                     backend: str) -> nn.Module:
    """The FMS model of the checkpoint in ``path``, in ``dtype``, this
    rank's shard of it when ``tp_size > 1``, ready for inference."""
    from fms.models import get_model
    start = time.perf_counter()
    parallel = {}
    if tp_size > 1:
        import torch.distributed as dist
        if backend != "sendnn":
            _keep_embedding_whole()
        parallel = dict(distributed_strategy="tp", group=dist.group.WORLD)
    model = get_model(**spyre_families.fms_model_args(path, hf_config),
                      data_type=dtype, device_type="cpu", **parallel)
    spyre_families.family_of(hf_config).prepare(model)
    model.eval()
    model.requires_grad_(False)
    logger.info("Loaded FMS model %s from %s in %.1f s",
                type(model).__name__, path, time.perf_counter() - start)
    return model


def _keep_embedding_whole() -> None:
    """gloo (the CPU process group) lacks all_gather_into_tensor, which
    FMS's tensor-parallel word embedding needs: keep that module whole on
    every rank.  FMS reads DISTRIBUTED_STRATEGY_IGNORE_MODULES when
    fms.distributed.strategy is first imported, so a process that imported
    it already gets the module name added to the parsed list as well."""
    from fms.distributed import strategy
    names = [n for n in os.environ.get("DISTRIBUTED_STRATEGY_IGNORE_MODULES",
                                       "").split(",") if n]
    if "WordEmbedding" not in names:
        os.environ["DISTRIBUTED_STRATEGY_IGNORE_MODULES"] = ",".join(
            names + ["WordEmbedding"])
    ignored = strategy._distributed_strategy_ignore_modules
    if "WordEmbedding" not in ignored:
        ignored.append("WordEmbedding")
