"""Registration of the Spyre attention ops with FMS.

FMS's model code picks its attention by name (``attn_name``) from a
process-wide registry (``fms.modules.attention.register_attention_op``).
Each Spyre cache (``spyre_static_cache``, ``spyre_paged_cache``, ``spyre_encoder_attention``)
registers its ops through ``register_ops``, which adds a name only once per
process, however many models are built in it.
"""
from __future__ import annotations

from typing import Any, Mapping


def register_ops(ops: Mapping[str, Mapping[str, Any]]) -> None:
    """Registers each op of ``ops`` (name -> keyword arguments of FMS's
    ``register_attention_op``: ``store_op``, ``compute_op`` and any of its
    optional ops) unless FMS knows that name already."""
    from fms.modules import attention
    for name, kwargs in ops.items():
        try:
            attention.get_attention_type(attn_name=name)
        except KeyError:
            attention.register_attention_op(name, **kwargs)
