"""When a model runs on the project's C++ kernels
(vllm/spyre_kernels/ops.py): on both CPU backends wherever they
build, unless VLLM_SPYRE_NATIVE_KERNELS=0; never on the card."""
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
