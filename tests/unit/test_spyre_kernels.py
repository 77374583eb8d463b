"""When a model runs on the project's C++ kernels
(vllm/spyre_kernels/ops.py): on both CPU backends wherever they
build, unless VLLM_SPYRE_NATIVE_KERNELS=0; never on the card."""
import platform

import pytest

from vllm.spyre_kernels import ops as native
from vllm.config.spyre import SpyreConfig


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_both_cpu_backends_use_the_kernels_where_they_build(
        monkeypatch, backend):
    monkeypatch.setattr(native, "available", lambda: True)
    assert native.in_use(backend, True) == (True, f"backend {backend}")


def test_the_switch_keeps_pytorch_ops(monkeypatch):
    monkeypatch.setattr(native, "available", pytest.fail)
    assert native.in_use("eager", False) == (False,
                                             "VLLM_SPYRE_NATIVE_KERNELS=0")


def test_the_card_never_uses_them(monkeypatch):
    monkeypatch.setattr(native, "available", pytest.fail)
    use, why = native.in_use("sendnn", True)
    assert not use and "sendnn" in why


def test_a_failed_build_is_named(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "_failure", "no C++ compiler found")
    assert native.in_use("inductor", True) == (
        False, "they could not be built (no C++ compiler found)")


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True),
                                             ("0", False)])
def test_the_setting_reaches_the_config(value, expected):
    env = {} if value is None else {"VLLM_SPYRE_NATIVE_KERNELS": value}
    config = SpyreConfig.from_env(environ=dict(
        env, VLLM_SPYRE_DYNAMO_BACKEND="eager"))
    assert config.native_kernels is expected
    assert SpyreConfig.from_dict(config.to_dict()).native_kernels is expected


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="x86 targets of the compiler")
def test_another_targets_flags_are_the_targets(monkeypatch):
    """Kernels built for another x86 target (``load_for``, for the
    benchmarks' ``--march``): ``cpu_has`` answers for that target, so the
    engine chooses the paths its build has."""
    monkeypatch.setattr(native, "_cpu_flags",
                        frozenset({"avx2", "avx512f", "avx512bw",
                                   "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(native, "_target_macros", None)
    assert native.cpu_has("avx512bw") and native.has_amx_bf16()
    monkeypatch.setattr(native, "_target_macros",
                        native._macros("x86-64-v3"))
    assert native.cpu_has("avx2")
    assert not native.cpu_has("avx512f") and not native.cpu_has("avx512bw")
    assert not native.has_amx_bf16()
    # A flag the CPU lacks stays absent whatever the target has.
    monkeypatch.setattr(native, "_target_macros",
                        native._macros("sapphirerapids"))
    assert native.cpu_has("amx_bf16") and not native.cpu_has("avx_vnni")


def test_load_for_refuses_what_is_no_target(monkeypatch):
    monkeypatch.setattr(native, "_loaded", None)
    with pytest.raises(ValueError, match="not a compiler target"):
        native.load_for("x86-64-v3 -O0")
    monkeypatch.setattr(native, "_loaded", True)
    with pytest.raises(RuntimeError, match="loaded already"):
        native.load_for("x86-64-v3")
