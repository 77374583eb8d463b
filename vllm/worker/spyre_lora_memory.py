"""The LoRA adapters' part of the up-front memory check
(``spyre_memory``): what ``--enable-lora`` adds to a rank's weights, from
the model's geometry and vLLM's LoRA settings alone (docs/lora.md)."""
from __future__ import annotations

from vllm.worker.spyre_memory import Geometry


def lora_slot_elements(geometry: Geometry, rank: int,
                       extra_vocab: int, vocab_padding: int = 256) -> int:
    """Elements one LoRA adapter slot of rank ``rank`` takes on this rank,
    as vLLM's LoRA layers stack them (``vllm.lora.spyre_lora``): per
    layer, A (``[r, in]``, the full input of a column-parallel layer, this
    rank's share of a row-parallel one's) and B (``[out, r]``, the
    converse) of q, k, v, o, gate, up and down; the token embedding's A
    over the vocabulary and its added tokens, and B; the output head's A,
    its B over the same padded to ``vocab_padding``; and the embeddings of
    the added tokens, held by the embedding and by the head."""
    g = geometry
    q, kv = g.heads * g.head_size, g.kv_heads * g.head_size
    per_layer = (3 * g.hidden + q + 2 * kv  # q, k, v
                 + q + g.hidden  # o
                 + 2 * (g.hidden + g.intermediate)  # gate, up
                 + g.intermediate + g.hidden)  # down
    embedding = g.vocab + extra_vocab + g.hidden
    padded_vocab = -(-(g.vocab + extra_vocab) // vocab_padding) * \
        vocab_padding
    head = g.hidden + padded_vocab
    return (rank * (g.layers * per_layer + embedding + head) +
            2 * extra_vocab * g.hidden)


#: What LoRA adds beyond its tensors (vLLM's LoRA modules and layers, their
#: index buffers): about 48 MiB, the same on SmolLM2 and at Granite 3.3
#: 2B's shapes (``benchmarks/lora.py``, docs/lora.md).
LORA_OVERHEAD = 48 * 2**20


def lora_bytes(geometry: Geometry, lora_config) -> int:
    """Bytes of LoRA adapters on this rank (``--enable-lora``): the
    ``--max-loras`` slots the layers hold, the adapters kept in memory
    besides (``--max-cpu-loras``), each counted at ``--max-lora-rank``,
    the rows of the added tokens in the model's own embedding and head
    (vLLM's model classes grow both by ``--lora-extra-vocab-size`` under
    LoRA), and ``LORA_OVERHEAD``."""
    if lora_config is None:
        return 0
    kept = lora_config.max_loras + (lora_config.max_cpu_loras or
                                    lora_config.max_loras)
    extra = lora_config.lora_extra_vocab_size
    grown = 2 * extra * geometry.hidden * geometry.item  # embedding, head
    return LORA_OVERHEAD + grown + kept * lora_item(lora_config, geometry) * \
        lora_slot_elements(geometry, lora_config.max_lora_rank, extra)


def lora_item(lora_config, geometry: Geometry) -> int:
    """Bytes per element of the adapters' tensors: ``--lora-dtype``
    (vLLM resolves ``auto`` to the dtype served: bfloat16 adapters for a
    bfloat16 model, whose other tensors the CPU may hold in float32)."""
    import torch
    dtype = lora_config.lora_dtype
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return geometry.item
