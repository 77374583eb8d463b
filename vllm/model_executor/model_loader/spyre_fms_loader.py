"""Loading an FMS decoder for Spyre from a Hugging Face folder.

``load_fms_decoder`` builds the model with FMS's ``get_model`` from the
arguments the family table gives (``spyre_families.fms_model_args``: FMS's
own mapping of ``config.json`` with the family's corrections and checkpoint
adapter), shards it over the tensor-parallel group, runs the family's
``prepare`` step (Mixtral's dense experts) and freezes it for inference.
``FmsModelCode`` then swaps in the CPU kernels; ``SpyreCausalLM``
compiles it.

FMS builds the model on the meta device and reads the checkpoint one
tensor at a time (memory-mapped safetensors), each into the dtype it is
given.  A bfloat16 checkpoint served in bfloat16 on the CPU is read in
bfloat16 (``spyre_dtypes.load_dtype``): the linear weights stay as read
until the kernels pack them, and only the model's own tensors (embedding,
norms) are widened to float32, so no float32 copy of a linear layer is
ever made and the load peaks near the bytes the model holds.  A float32
checkpoint served so is read in float32, but each weight the kernels will
pack is converted to bfloat16 as it is read (``reads_linears_narrow``),
so the model never holds its linear layers in float32 either.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Optional

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.models import spyre_families
from vllm.model_executor.models.spyre_dtypes import (Precision, load_dtype,
                                                     reads_linears_narrow,
                                                     stored_dtypes)

logger = init_logger(__name__)


class _OneProcess:
    """A process group of this process alone, as FMS's ``get_model`` asks
    it its size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def load_fms_decoder(path: str, hf_config, precision: Precision,
                     tp_size: int, backend: str,
                     packed: bool = False) -> nn.Module:
    """The FMS model of the checkpoint in ``path``, its tensors in
    ``precision.model`` except the weights of plain linear layers, which
    may be held in ``precision.linear`` (``hold``; ``packed``: the kernels
    will pack them in it), this rank's shard of it when ``tp_size > 1``
    (else all of it), ready for inference."""
    from fms.models import get_model
    start = time.perf_counter()
    stored = stored_dtypes(path)
    dtype = load_dtype(precision, stored)
    narrow = precision.linear if dtype != precision.linear and \
        reads_linears_narrow(precision, stored, tp_size, packed) else None
    parallel = {}
    if tp_size > 1:
        import torch.distributed as dist
        if backend != "sendnn":
            _keep_embedding_whole()
        parallel = dict(distributed_strategy="tp", group=dist.group.WORLD)
    else:
        # Whole, also in a rank of a tensor-parallel engine (a speculative
        # draft model in the driver's process): FMS shards over the world
        # group unless it is given a group of one process.
        parallel = dict(group=_OneProcess())
    with _adopting_fresh_tensors(narrow):
        model = get_model(**spyre_families.fms_model_args(path, hf_config),
                          data_type=dtype, device_type="cpu", **parallel)
    read = time.perf_counter() - start
    widened = hold(model, precision.model) if dtype != precision.model else 0
    spyre_families.family_of(hf_config).prepare(model)
    model.eval()
    model.requires_grad_(False)
    as_read = f"in {_name(dtype)}" + (
        f", the packed layers' weights converted to {_name(narrow)}"
        if narrow is not None else "")
    logger.info(
        "Loaded FMS model %s from %s in %.1f s (read %s: %.1f s; %d "
        "tensors widened to %s)", type(model).__name__, path,
        time.perf_counter() - start, as_read, read, widened,
        _name(precision.model))
    return model


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _adopting_fresh_tensors(
        narrow: Optional[torch.dtype] = None) -> Iterator[None]:
    """While FMS loads a checkpoint: a tensor its adapter made for the
    model (the query/key/value and gate projections concatenated into
    fused weights, a rotary permutation) becomes the model's parameter
    itself where it has the parameter's shape and dtype, instead of being
    copied into a fresh one.  That copy was a second pass over most of a
    decoder's bytes, each page of it faulted in.  Tensors read from the
    mapped file, tensor-parallel shards and conversions are left to FMS.

    ``narrow``: the weights of the linear layers the kernels will pack
    (``spyre_linear.packed_alone``) are converted to it instead, each as
    it is read.

    FMS loads each group of tensors through its module's
    ``_load_partial_state_dict``, which this wraps for the duration."""
    from fms.utils import serialization

    from vllm.model_executor.layers.spyre_linear import packed_alone
    original = serialization._load_partial_state_dict
    targets: dict[int, set[str]] = {}

    def load(model, state_dict, needs_tp_sharding, dtype=None):
        if not needs_tp_sharding:
            if narrow is not None and id(model) not in targets:
                targets[id(model)] = packed_alone(model, narrow)
            packed = targets.get(id(model), set())
            state_dict = {
                key: value for key, value in state_dict.items()
                if not _adopt(model, key, value, dtype, narrow
                              if key in packed else None)}
        return original(model, state_dict, needs_tp_sharding, dtype)

    serialization._load_partial_state_dict = load
    try:
        yield
    finally:
        serialization._load_partial_state_dict = original


def _adopt(model: nn.Module, key: str, value, dtype,
           narrow: Optional[torch.dtype] = None) -> bool:
    """Makes ``value`` the tensor ``key`` names in ``model`` where that is
    still on the meta device and ``value`` is a whole CPU tensor PyTorch
    allocated (nothing else can hold it: the adapter just made it) of its
    shape and of the dtype FMS would copy it into; True if it did.
    ``narrow``: ``value`` converted to that dtype instead (a copy of its
    own, whatever ``value`` is)."""
    from vllm.model_executor.layers.spyre_linear import owns_storage
    if narrow is not None and isinstance(value, torch.Tensor) and \
            value.is_floating_point():
        held = value.detach().to(narrow)
        if held.data_ptr() == value.data_ptr() and not owns_storage(held):
            held = held.clone()
        value, dtype = held, narrow
    path, _, name = key.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    table = module._parameters if name in module._parameters else \
        module._buffers if name in module._buffers else None
    current = table.get(name) if table is not None else None
    if current is None or not current.is_meta or \
            not isinstance(value, torch.Tensor) or \
            value.device.type != "cpu" or value.shape != current.shape or \
            value.dtype != (dtype or value.dtype) or \
            not owns_storage(value):
        return False
    table[name] = (nn.Parameter(value, requires_grad=current.requires_grad)
                   if isinstance(current, nn.Parameter) else value)
    return True


def hold(model: nn.Module, dtype: torch.dtype) -> int:
    """Widens to ``dtype`` every floating-point tensor of ``model`` except
    the weights of plain linear layers (``spyre_linear.plain_linear_types``)
    that no other module shares: those stay as read, for the kernels to
    pack.  A tensor shared by several modules (a head tied to the
    embedding) is widened once and stays shared.  Returns how many tensors
    were widened."""
    from vllm.model_executor.layers.spyre_linear import plain_linear_types
    plain = plain_linear_types()
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, t in list(module._parameters.items()) + list(
                module._buffers.items()):
            if t is not None:
                users.setdefault(id(t), []).append((module, name))
    widened: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or \
                        t.dtype == dtype or t.element_size() > \
                        torch.empty((), dtype=dtype).element_size():
                    continue
                if all(type(m) in plain and n == "weight"
                       for m, n in users[id(t)]):
                    continue
                new = widened.get(id(t))
                if new is None:
                    data = t.detach().to(dtype)
                    new = (nn.Parameter(data, requires_grad=False)
                           if isinstance(t, nn.Parameter) else data)
                    widened[id(t)] = new
                table[name] = new
    return len(widened)


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
