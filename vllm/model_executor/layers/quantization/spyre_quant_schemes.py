"""What Spyre reads from a checkpoint's ``quantization_config``.

``gptq_scheme`` and ``compressed_tensors_schemes`` turn GPTQ's and
compressed-tensors' configs into ``Scheme`` s (format, bits, groups,
FP8 input quantization), refusing what Spyre does not run with an
``UnsupportedQuantization`` that names the value and lists ``SUPPORTED``.
``spyre_quant`` builds vLLM's quantization method on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: The vLLM quantization method name.
NAME = "spyre"
#: The checkpoint methods it reads.
METHODS = ("gptq", "compressed-tensors")

SUPPORTED = (
    "GPTQ (4 or 8 bits, any group size or -1, desc_act false) and compressed-tensors (float-quantized FP8 weights, "
    "per tensor or per channel, with static per-tensor, dynamic per-token "
    "or no input quantization; pack-quantized int8 or int4 symmetric "
    "weight-only, per channel or per group)")


class UnsupportedQuantization(ValueError):
    """A quantization config Spyre does not run."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is not supported on Spyre. Supported "
                         f"quantization: {SUPPORTED}.")


@dataclass(frozen=True)
class Scheme:
    """How one layer's weight (and input) is quantized."""

    #: "gptq", "fp8" (float8_e4m3fn codes) or "int" (pack-quantized).
    format: str
    bits: int
    #: Input features per scale; -1: one group over all of them.
    group_size: int
    symmetric: bool = True
    #: "tensor", "channel" or "group".
    strategy: str = "group"
    #: FP8 inputs: None (weight-only), "static" or "dynamic".
    activations: Optional[str] = None
    #: GPTQ zero points stored minus one (checkpoint format "gptq").
    zeros_minus_one: bool = True

    def describe(self) -> str:
        if self.format == "fp8":
            inputs = {None: "weight-only", "static": "static input scales",
                      "dynamic": "dynamic per-token inputs"}[self.activations]
            return f"FP8 ({self.strategy} weight scales, {inputs})"
        groups = ("per channel" if self.group_size == -1 else
                  f"group {self.group_size}")
        kind = "GPTQ" if self.format == "gptq" else "int"
        return (f"{kind} {self.bits}-bit {groups}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}")


# ---- reading the checkpoint's quantization_config ---------------------------
def gptq_scheme(cfg: dict[str, Any]) -> Scheme:
    bits = cfg.get("bits")
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"GPTQ with bits={bits}")
    group = cfg.get("group_size", -1)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise UnsupportedQuantization(f"GPTQ with group_size={group}")
    if cfg.get("desc_act"):
        raise UnsupportedQuantization(
            "GPTQ with desc_act=true (activation order)")
    if cfg.get("dynamic"):
        raise UnsupportedQuantization(
            "GPTQ with per-module settings ('dynamic')")
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format={fmt!r}")
    return Scheme("gptq", bits, group, symmetric=bool(cfg.get("sym", True)),
                  strategy="channel" if group == -1 else "group",
                  zeros_minus_one=fmt == "gptq")


def _ct_scheme(name: str, group: dict[str, Any], fmt: str) -> Scheme:
    """One compressed-tensors config group's scheme."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    if group.get("output_activations"):
        raise UnsupportedQuantization(
            f"compressed-tensors output activation quantization ({name})")
    wtype, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if not weights.get("symmetric", True):
        raise UnsupportedQuantization(
            f"compressed-tensors asymmetric weights ({name})")
    if weights.get("actorder"):
        raise UnsupportedQuantization(
            f"compressed-tensors actorder={weights['actorder']!r} ({name})")
    if wtype == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise UnsupportedQuantization(
                f"compressed-tensors FP8 weights with strategy {strategy!r} "
                f"({name})")
        activations = None
        if inputs:
            if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
                raise UnsupportedQuantization(
                    f"compressed-tensors FP8 weights with "
                    f"{inputs.get('type')} {inputs.get('num_bits')}-bit "
                    f"inputs ({name})")
            if inputs.get("dynamic"):
                if inputs.get("strategy") != "token":
                    raise UnsupportedQuantization(
                        "compressed-tensors dynamic input quantization "
                        f"with strategy {inputs.get('strategy')!r} ({name})")
                activations = "dynamic"
            elif inputs.get("strategy") == "tensor":
                activations = "static"
            else:
                raise UnsupportedQuantization(
                    "compressed-tensors static input quantization with "
                    f"strategy {inputs.get('strategy')!r} ({name})")
        return Scheme("fp8", 8, -1, strategy=strategy,
                      activations=activations)
    if wtype == "int" and bits in (4, 8):
        if inputs:
            raise UnsupportedQuantization(
                f"compressed-tensors int{bits} weights with quantized "
                f"inputs ({name})")
        if fmt != "pack-quantized":
            raise UnsupportedQuantization(
                f"compressed-tensors int{bits} weights in format {fmt!r}")
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = weights.get("group_size")
        else:
            raise UnsupportedQuantization(
                f"compressed-tensors int weights with strategy "
                f"{strategy!r} ({name})")
        return Scheme("int", bits, group_size, strategy=strategy)
    raise UnsupportedQuantization(
        f"compressed-tensors {wtype} {bits}-bit weights ({name})")


def compressed_tensors_schemes(
        cfg: dict[str, Any]) -> tuple[dict[str, Scheme], list[str]]:
    """{target: scheme} and the ignore list of a compressed-tensors
    config."""
    fmt = cfg.get("format")
    if fmt not in ("float-quantized", "pack-quantized", "naive-quantized"):
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r}")
    if cfg.get("kv_cache_scheme"):
        raise UnsupportedQuantization(
            "a quantized key/value cache (compressed-tensors "
            "kv_cache_scheme)")
    targets: dict[str, Scheme] = {}
    for name, group in (cfg.get("config_groups") or {}).items():
        scheme = _ct_scheme(name, group, group.get("format") or fmt)
        for target in group.get("targets") or []:
            targets[target] = scheme
    if not targets:
        raise UnsupportedQuantization(
            "a compressed-tensors config without config_groups")
    return targets, list(cfg.get("ignore") or [])
