"""LoRA adapters on Spyre: vLLM's adapter manager over vLLM's model code.

``--enable-lora`` (``LLM(enable_lora=True)``) serves many adapters over one
base model, as vLLM does: each request names its adapter
(``LoRARequest``; the OpenAI server's ``model``), adapters load from disk
at their first request or through ``/v1/load_lora_adapter``, and up to
``--max-loras`` of them run in one step, each row with its own or none.

What is vLLM's and what is Spyre's:

* vLLM's LRU adapter manager (``LRUCacheWorkerLoRAManager``) wraps the
  model's linear layers, token embedding and logits in its LoRA layers and
  keeps the adapters, ``--max-cpu-loras`` in memory and ``--max-loras`` in
  the stacked tensors the layers read;
* the base layers keep their packed kernels (each LoRA layer calls its base
  layer's ``quant_method``);
* the adapters' products run inside the compiled graphs on the platform's
  punica wrapper (``spyre_punica``), with no branch on the step, so the
  graphs warm-up compiled serve every mix of adapters;
* an adapter loads from a local folder only, and only if its matrices
  fit the base model's projections (``check_shapes``: vLLM would copy a
  smaller matrix into a corner of its slot without a word);
* ``SpyreLoRA.set_step`` tells the layers which adapter each row of the
  next forward uses (vLLM's ``LoRAMapping``: a lora id per token and per
  row, 0 for none).

LoRA runs on vLLM's model code on the CPU backends (``check_config``):
FMS's model code has no LoRA layers, and the card's graphs have not been
built with them.
"""
from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn

from vllm.config.spyre_model_facts import VLLM
from vllm.logger import init_logger
from vllm.lora.layers import (LogitsProcessorWithLoRA, LoRAMapping,
                              VocabParallelEmbeddingWithLoRA)
from vllm.lora.models import LRUCacheLoRAModelManager
from vllm.lora.punica_wrapper.spyre_punica import tile_b_
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def check_config(vllm_config: "VllmConfig", model_impl: str,
                 backend: str) -> None:
    """Refuses, before anything loads, LoRA where Spyre cannot serve it."""
    lora_config = vllm_config.lora_config
    if lora_config is None:
        return
    if model_impl != VLLM:
        arch = vllm_config.model_config.architectures[0]
        raise NotImplementedError(
            f"LoRA adapters on Spyre run on vLLM's model code: start with "
            f"--model-impl vllm (here {arch} would run FMS's model code, "
            "which has no LoRA layers)")
    if backend == "sendnn":
        raise NotImplementedError(
            "LoRA adapters run on the CPU backends "
            "(VLLM_SPYRE_DYNAMO_BACKEND=eager or inductor), not yet on the "
            "card (sendnn): see docs/lora.md")
    if lora_config.bias_enabled:
        raise NotImplementedError(
            "--enable-lora-bias is not supported on Spyre")
    logger.info(
        "Spyre LoRA: up to %d adapter(s) per step (--max-loras), rank up "
        "to %d (--max-lora-rank), %d kept in memory (--max-cpu-loras)",
        lora_config.max_loras, lora_config.max_lora_rank,
        lora_config.max_cpu_loras or lora_config.max_loras)


class _Slots(LRUCacheLoRAModelManager):
    """vLLM's manager of the adapter slots.  Once vLLM's layers have copied
    an adapter into its slot: where the products run on the C++ kernel,
    its B matrices laid out as the kernel reads them
    (``spyre_punica.tile_b_``; the token embedding's products run on torch
    ops and keep vLLM's layout); and the punica wrapper told whether it
    adapts the output head (``head_slots``), whose product, outside the
    graphs, is skipped while no slot does."""

    def activate_adapter(self, lora_id: int) -> bool:
        if not super().activate_adapter(lora_id):
            return False
        slot = self.lora_index_to_id.index(lora_id)
        adapter = self._registered_adapters[lora_id]
        punica = self.punica_wrapper
        for name, module in self.modules.items():
            if isinstance(module, LogitsProcessorWithLoRA):
                punica.head_slots[slot] = self._get_lora_layer_weights(
                    adapter, name) is not None
            if not punica.native or isinstance(
                    module, VocabParallelEmbeddingWithLoRA):
                continue
            b = module.lora_b_stacked
            for tensor in (b if isinstance(b, tuple) else (b, )):
                tile_b_(tensor, slot)
        return True


class _Manager(LRUCacheWorkerLoRAManager):
    """vLLM's LRU adapter manager, loading adapters from local folders
    only, each checked against the base model (in ``base_dir``, whose
    tensors' shapes are read once, at the first load) first."""

    _manager_cls = _Slots

    def __init__(self, base_dir: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._base_dir = base_dir
        self._base_shapes: Optional[dict[str, list[int]]] = None

    def _load_adapter(self, lora_request: LoRARequest):
        path = os.path.expanduser(lora_request.lora_path)
        if not os.path.isdir(path):
            raise ValueError(
                f"No adapter found at {lora_request.lora_path} (adapters "
                "are loaded from local folders)")
        if self._base_shapes is None:
            self._base_shapes = (tensor_shapes(self._base_dir)
                                 if os.path.isdir(self._base_dir) else {})
        check_shapes(self._base_shapes, path)
        return super()._load_adapter(lora_request)


class SpyreLoRA:
    """The adapters of one vLLM model (``model``, wrapped in place)."""

    def __init__(self, vllm_config: "VllmConfig", model: nn.Module,
                 max_tokens: int, native: bool) -> None:
        """``max_tokens``: the most tokens one forward takes (rows times
        length, over every compiled shape and scheduler limit);
        ``native``: the products run on the C++ kernel
        (``spyre_punica``)."""
        from vllm.model_executor.models import supports_lora
        if not supports_lora(model):
            raise NotImplementedError(
                f"{type(model).__name__} does not support LoRA in vLLM")
        lora_config = vllm_config.lora_config
        assert lora_config is not None
        self.max_loras = lora_config.max_loras
        #: The adapters and lora id of the sequence ``one_sequence`` named.
        self._sequence: tuple = ((), 0)
        #: The stacked tensors' geometry, which the graphs are built for.
        self.slots = (lora_config.max_loras, lora_config.max_lora_rank)
        scheduler_config = vllm_config.scheduler_config
        text_config = vllm_config.model_config.hf_config.get_text_config()
        self.manager = _Manager(
            vllm_config.model_config.model,
            scheduler_config.max_num_seqs,
            max_tokens,
            vllm_config.model_config.get_vocab_size(),
            lora_config,
            torch.device("cpu"),
            model.embedding_modules,
            model.embedding_padding_modules,
            max_position_embeddings=text_config.max_position_embeddings)
        self.manager.create_lora_manager(model)
        self.manager._adapter_manager.punica_wrapper.native = native
        self.layers = len(self.manager._adapter_manager.modules)
        logger.info("Spyre LoRA: %d layers wrapped for %d adapter slot(s)",
                    self.layers, self.max_loras)

    def set_step(self, loras: Optional["StepAdapters"], rows: int,
                 length: int, logits_per_row: int = 1) -> None:
        """The next forward: ``rows`` rows of ``length`` tokens; ``loras``
        the step's adapters and the lora ids of its first rows (the live
        ones; the rest, padding, use none), or None: no adapter; the
        logits of ``logits_per_row`` positions of each row follow (a
        speculative verify step's: all of them)."""
        adapters, ids = loras or ((), ())
        ids = tuple(ids) + (0, ) * (rows - len(ids))
        self._set(adapters, ids, length, logits_per_row)

    def one_sequence(self, adapters: Iterable[LoRARequest], lora_id: int,
                     length: int) -> None:
        """The next forward: one sequence of ``length`` tokens run whole
        (prompt log-probabilities), on adapter ``lora_id``; its logits
        follow, ``sequence_rows`` before each call."""
        self._sequence = (tuple(adapters), lora_id)
        self._set(adapters, (lora_id, ) * length, 1)

    def sequence_rows(self, rows: int) -> None:
        """The next logits: ``rows`` positions of the sequence
        ``one_sequence`` named."""
        adapters, lora_id = self._sequence
        self._set(adapters, (lora_id, ) * rows, 1)

    def _set(self, adapters: Iterable[LoRARequest], ids: tuple[int, ...],
             length: int, logits_per_row: int = 1) -> None:
        """vLLM's ``LoRAMapping``: a lora id per token (each row's,
        ``length`` times) and per position whose logits are computed
        (each row's, ``logits_per_row`` times); the adapters named are
        loaded if they are not."""
        mapping = LoRAMapping(
            index_mapping=tuple(i for i in ids for _ in range(length)),
            prompt_mapping=tuple(i for i in ids
                                 for _ in range(logits_per_row)),
            is_prefill=length > 1)
        self.manager.set_active_adapters(set(adapters), mapping)

    # ---- vLLM's worker interface ------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        return self.manager.add_adapter(request)

    def remove(self, lora_id: int) -> bool:
        return self.manager.remove_adapter(lora_id)

    def pin(self, lora_id: int) -> bool:
        return self.manager.pin_adapter(lora_id)

    def list(self) -> set[int]:
        return self.manager.list_adapters()


#: A step's adapters and the lora id of each of its live rows.
StepAdapters = tuple[tuple[LoRARequest, ...], tuple[int, ...]]


def step_adapters(metas: Iterable) -> tuple[LoRARequest, ...]:
    """The adapters the step's sequence groups name, each once."""
    found: dict[int, LoRARequest] = {}
    for meta in metas:
        if meta.lora_request is not None:
            found.setdefault(meta.lora_int_id, meta.lora_request)
    return tuple(found.values())


def tensor_shapes(folder: str) -> dict[str, list[int]]:
    """Every tensor's shape in the safetensors files of ``folder``, read
    from their headers."""
    from safetensors import safe_open
    shapes: dict[str, list[int]] = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


def check_shapes(base: dict[str, list[int]], adapter_dir: str) -> None:
    """Refuses an adapter whose ``lora_A`` (``[rank, in]``) or ``lora_B``
    (``[out, rank]``) does not fit the base model's weight (``[out,
    in]``; ``base``: the base checkpoint's ``tensor_shapes``) of the
    module it adapts.  Skipped where either checkpoint is not in
    safetensors files."""
    adapter = tensor_shapes(adapter_dir)
    if not adapter or not base:
        return
    for key, shape in adapter.items():
        if ".lora_A." in key:
            module, side = key.split(".lora_A.")[0], 1
        elif ".lora_B." in key:
            module, side = key.split(".lora_B.")[0], 0
        else:
            continue
        module = module.removeprefix("base_model.model.")
        weight = base.get(module + ".weight")
        if weight is None:
            continue  # vLLM's load names modules the model lacks
        if shape[side] != weight[side]:
            what = "inputs" if side == 1 else "outputs"
            raise ValueError(
                f"the adapter does not fit this base model: "
                f"{key} is {shape}, but {module} has {weight[side]} "
                f"{what} (weight {weight}); was it trained for another "
                "model?")
