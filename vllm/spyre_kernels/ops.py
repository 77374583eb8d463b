"""The C++ kernels: one extension, built on first use, and the CPU's flags.

The CPU stand-in for the card runs its hot loops in C++ kernels of this
project, the sources beside this module, registered as ``torch.library``
ops of the ``spyre_kernels`` library so that inductor calls them like any
other external kernel:

* ``spyre_kernels::packed_linear`` (``linear.cpp``): linear layers whose
  weights were packed once (``vllm.model_executor.layers.spyre_linear``);
* ``spyre_kernels::quant_linear`` (``quant.cpp``): linear layers of
  quantized checkpoints, their int8, FP8 or int4 codes dequantized in
  registers (``vllm.model_executor.layers.quantization.spyre_quant_linear``),
  and ``spyre_kernels::unpack_codes`` and
  ``spyre_kernels::pack_code_words``, which read quantized codes out of
  their int32 words at load time, the latter straight into the kernel's
  layout
  (``vllm.model_executor.layers.quantization.spyre_quant_linear``);
* ``spyre_kernels::decode_attention``, ``spyre_kernels::paged_attention``
  and ``spyre_kernels::encoder_attention`` (``attention.cpp``): attention
  over the static cache (``spyre_static_cache``), the block pool
  (``spyre_paged_cache``) and the packed texts of an encoder
  (``spyre_encoder_attention``);
* ``spyre_kernels::store_static_kv``, ``store_paged_kv``,
  ``decode_attention_heads`` and ``paged_attention_heads``
  (``cached_attention.cpp``): a layer's cache write, and its attention
  over the query's own layout, one call each, FMS's attention ops under
  ``eager``; ``store_decode_attention`` and ``store_paged_attention``:
  both in one call, for vLLM's model code under ``eager``
  (``spyre_attn``'s ``AttentionStep``);
* ``spyre_kernels::rms_norm`` and ``spyre_kernels::rotary_qk``
  (``elementwise.cpp``): a decoder's norms and rotary embedding in one
  pass each, for ``eager``, which has no compiler to fuse them
  (``vllm.model_executor.layers.spyre_fused_ops``);
* ``spyre_kernels::add_rms_norm``, ``spyre_kernels::rotary_cos_sin`` and
  ``spyre_kernels::silu_and_mul`` (``vllm_elementwise.cpp``): vLLM's RMS
  norm (residual add included), rotary embedding and gated activation in
  their native forms, one pass each, for ``eager`` in vLLM's model code
  (``vllm.model_executor.layers.spyre_vllm_fused_ops``);
* ``spyre_kernels::lora_add_`` (``lora.cpp``): the LoRA adapters'
  products of a step's rows added to a layer's output, each row on its own
  adapter
  (``vllm.lora.punica_wrapper.spyre_punica``).

All but ``cached_attention.cpp`` share ``simd.h``: the vector width and
types, and the argument checks of more than one op.

``available`` builds the sources into one extension with PyTorch's C++
extension loader (the compiler inductor needs anyway), cached in
``TORCH_EXTENSIONS_DIR``, loads it and registers each op's fake (shape-only)
implementation for tracing.  ``in_use`` decides, for a model, whether it
runs on them: on both CPU backends (``eager`` skips the compiler, not the
kernels) unless ``VLLM_SPYRE_NATIVE_KERNELS=0`` asks for PyTorch's own ops.
A machine without a compiler gets ``False`` and a warning, and every caller
keeps its torch-op path.  ``cpu_has`` reads the CPU's flags, which choose
between the kernels' paths (AVX512_BF16, AMX) and name them in the graph
cache's key.  ``load_for`` builds them for another x86 target instead
(``x86-64-v3``: an AVX2-only CPU's code, measured by the benchmarks'
``--march`` on a larger CPU), and ``cpu_has`` then answers for it.

The kernels sit low in the project's layers: the attention ops, the
layers, the models and the graph cache import this module, which imports
none of theirs.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Optional

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

#: The library of the ops, and the name of the extension that holds them.
LIBRARY = "spyre_kernels"
_SOURCES = [Path(__file__).with_name(name) for name in
            ("linear.cpp", "attention.cpp", "cached_attention.cpp",
             "elementwise.cpp", "quant.cpp", "lora.cpp",
             "vllm_elementwise.cpp")]
_NATIVE_FLAG = {"x86_64": "-march=native", "s390x": "-march=native",
                "ppc64le": "-mcpu=native", "aarch64": "-mcpu=native"}
_loaded: Optional[bool] = None
_cpu_flags: Optional[frozenset] = None
#: The instruction sets of the target ``load_for`` built for (None: this
#: CPU's own build).
_target_macros: Optional[frozenset] = None
#: Why the build failed, when it did.
_failure = ""


def _flag_key(name: str) -> str:
    """A CPU flag (``avx512_bf16``) or the compiler's macro for it
    (``__AVX512BF16__``) in one spelling: ``AVX512BF16``."""
    return name.replace("_", "").upper()


def cpu_has(flag: str) -> bool:
    """Whether the CPU's flags (Linux's ``/proc/cpuinfo``) name ``flag``;
    where the kernels were built for another target (``load_for``), only
    if that target has it too."""
    global _cpu_flags
    if _cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                _cpu_flags = frozenset(
                    word for line in f if line.startswith("flags")
                    for word in line.split()[2:])
        except OSError:
            _cpu_flags = frozenset()
    if _target_macros is not None and _flag_key(flag) not in _target_macros:
        return False
    return flag in _cpu_flags


def _macros(target: str) -> frozenset:
    """The instruction-set macros the compiler defines for ``-march=target``,
    as ``_flag_key`` spells them."""
    import subprocess
    from torch.utils.cpp_extension import get_cxx_compiler
    done = subprocess.run(
        [get_cxx_compiler(), f"-march={target}", "-dM", "-E", "-x", "c++",
         "/dev/null"], capture_output=True, text=True, check=True)
    return frozenset(
        _flag_key(line.split()[1]) for line in done.stdout.splitlines()
        if line.startswith("#define __") and line.split()[1].endswith("__"))


def has_amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles: where prompts
    multiply on oneDNN."""
    return cpu_has("amx_bf16")


def available() -> bool:
    """Builds (first time on a machine) and loads the kernels; False, with
    a warning, where they cannot be built."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def load_for(target: str) -> bool:
    """Builds the kernels for another x86 target than this CPU
    (``-march=target``; ``x86-64-v3``: what a CPU with AVX2 and no
    AVX-512 runs) and loads them in place of the native ones, for a
    benchmark to measure a lesser CPU's code paths here.  Call it before
    anything loads the kernels; False, with a warning, where they cannot
    be built.  ``cpu_has`` then answers for that target: the paths the
    engine chooses by the CPU's flags are the target's."""
    global _loaded
    if _loaded is not None:
        raise RuntimeError("the native CPU kernels are loaded already: "
                           "load_for must come first")
    if not target.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"load_for({target!r}): not a compiler target")
    global _target_macros
    _target_macros = _macros(target)
    _loaded = _load(target)
    return _loaded


def loaded() -> bool:
    """Whether the kernels are built and loaded already (never builds
    them): for load-time helpers that take the kernels where a model runs
    on them and PyTorch's ops elsewhere."""
    return bool(_loaded)


def in_use(backend: str, wanted: bool) -> tuple[bool, str]:
    """Whether a model on ``backend`` runs on these kernels, and why (or
    why not): on both CPU backends, ``eager`` and ``inductor``, wherever
    they build, unless ``VLLM_SPYRE_NATIVE_KERNELS=0`` (``wanted``) keeps
    PyTorch's own ops; never on the card (``sendnn``)."""
    if backend == "sendnn":
        return False, "the card runs the graphs (backend sendnn)"
    if not wanted:
        return False, "VLLM_SPYRE_NATIVE_KERNELS=0"
    if not available():
        return False, f"they could not be built ({_failure})"
    return True, f"backend {backend}"


def _load(target: Optional[str] = None) -> bool:
    from torch.utils.cpp_extension import load
    flags = ["-O3", "-fopenmp"]
    native = _NATIVE_FLAG.get(platform.machine())
    if target:
        flags.append(f"-march={target}")
    elif native:
        flags.append(native)
    # Another target's build goes to a folder of its own, so that neither
    # build replaces the other.
    name = f"{LIBRARY}_{target.replace('-', '_')}" if target else LIBRARY
    start = time.perf_counter()
    try:
        load(name=name,
             sources=[str(p) for p in _SOURCES],
             extra_cflags=flags,
             extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as e:  # no compiler, or an unsupported platform
        global _failure
        _failure = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning(
            "The native CPU kernels could not be built (%s); linear layers "
            "stay on MKL and attention on torch ops", e)
        return False
    for op, fake in _FAKES.items():
        torch.library.register_fake(f"{LIBRARY}::{op}")(fake)
    logger.info("Loaded the native CPU kernels%s in %.1f s",
                f" (built for {target})" if target else "",
                time.perf_counter() - start)
    return True


def _fake(input: torch.Tensor, packed: torch.Tensor, out_features: int,
          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], out_features))


def _fake_quant(input: torch.Tensor, packed: torch.Tensor,
                scales: torch.Tensor, offsets: Optional[torch.Tensor],
                kind: int, group_size: int, out_features: int,
                zero_point: float, bias: Optional[torch.Tensor] = None,
                round_inputs: bool = False, dense_rows: int = 0,
                dot_rows: int = 0, int_rows: int = 0) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], out_features))


def _fake_attention(query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, mask: torch.Tensor,
                    scale: float,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], values.shape[-1]))


def _fake_paged_attention(query: torch.Tensor, key_pool: torch.Tensor,
                          value_pool: torch.Tensor, block_table: torch.Tensor,
                          ctx_lens: torch.Tensor, block_size: int,
                          scale: float, window: int = 0,
                          sinks: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], value_pool.shape[-1]))


def _fake_store_kv(keys: torch.Tensor, values: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                   cache_slots: torch.Tensor) -> None:
    return None


def _fake_attention_heads(query: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, mask: torch.Tensor,
                          scale: float,
                          sinks: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], values.shape[-1]))


def _fake_paged_attention_heads(query: torch.Tensor, key_pool: torch.Tensor,
                                value_pool: torch.Tensor,
                                block_table: torch.Tensor,
                                ctx_lens: torch.Tensor, block_size: int,
                                scale: float, window: int = 0,
                                sinks: Optional[torch.Tensor] = None
                                ) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], value_pool.shape[-1]))


def _fake_store_decode_attention(query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, key_cache: torch.Tensor,
                                 value_cache: torch.Tensor,
                                 cache_slots: torch.Tensor, mask: torch.Tensor,
                                 heads: int, scale: float) -> torch.Tensor:
    return query.new_empty((query.shape[0], heads * value_cache.shape[-1]))


def _fake_store_paged_attention(query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, key_pool: torch.Tensor,
                                value_pool: torch.Tensor,
                                cache_slots: torch.Tensor,
                                block_table: torch.Tensor,
                                ctx_lens: torch.Tensor, block_size: int,
                                heads: int, scale: float,
                                window: int) -> torch.Tensor:
    return query.new_empty((query.shape[0], heads * value_pool.shape[-1]))


def _fake_encoder_attention(query: torch.Tensor, keys: torch.Tensor,
                            values: torch.Tensor, text_starts: torch.Tensor,
                            scale: float,
                            bf16_products: bool) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], values.shape[-1]))


def _fake_rms_norm(input: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _fake_add_rms_norm(input: torch.Tensor,
                       residual: Optional[torch.Tensor],
                       weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(input, memory_format=torch.contiguous_format)
    return out, (torch.empty_like(out) if residual is not None else
                 input.new_empty((0, )))


def _fake_rotary_cos_sin(positions: torch.Tensor, query: torch.Tensor,
                         key: Optional[torch.Tensor], cache: torch.Tensor,
                         head_size: int, rotary_dim: int,
                         neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (query.new_empty(query.shape),
            key.new_empty(key.shape) if key is not None else
            query.new_empty((0, )))


def _fake_silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def _fake_rotary_qk(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor,
                    position_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _fake_lora_add(out: torch.Tensor, input: torch.Tensor, a0: torch.Tensor,
                   b0: torch.Tensor, a1: Optional[torch.Tensor],
                   b1: Optional[torch.Tensor], a2: Optional[torch.Tensor],
                   b2: Optional[torch.Tensor], slots: torch.Tensor,
                   scale: float, width0: int, width1: int,
                   width2: int) -> None:
    return None


#: Each op's fake (shape-only) implementation, registered for tracing.
def _fake_unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    return words.new_empty((words.shape[0] * (32 // bits), words.shape[1]),
                           dtype=torch.uint8)


def _fake_pack_code_words(words: torch.Tensor, bits: int, dim: int,
                          out_features: int) -> torch.Tensor:
    return words.new_empty((-(-out_features // 32),
                            words.shape[dim] * (32 // bits),
                            32 if bits == 8 else 16), dtype=torch.uint8)


_FAKES = {
    "packed_linear": _fake,
    "decode_attention": _fake_attention,
    "paged_attention": _fake_paged_attention,
    "store_static_kv": _fake_store_kv,
    "store_paged_kv": _fake_store_kv,
    "decode_attention_heads": _fake_attention_heads,
    "paged_attention_heads": _fake_paged_attention_heads,
    "store_decode_attention": _fake_store_decode_attention,
    "store_paged_attention": _fake_store_paged_attention,
    "encoder_attention": _fake_encoder_attention,
    "quant_linear": _fake_quant,
    "unpack_codes": _fake_unpack_codes,
    "pack_code_words": _fake_pack_code_words,
    "rms_norm": _fake_rms_norm,
    "add_rms_norm": _fake_add_rms_norm,
    "rotary_cos_sin": _fake_rotary_cos_sin,
    "silu_and_mul": _fake_silu_and_mul,
    "rotary_qk": _fake_rotary_qk,
    "lora_add_": _fake_lora_add,
}
