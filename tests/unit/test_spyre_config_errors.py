"""Settings that vllm/config/spyre.py refuses, each with a
message naming the value and what to change (no model, no engine)."""
import pytest

from vllm.config.spyre import SpyreConfig, WarmupShape

from spyre_env import no_sendnn, shapes_env  # noqa: F401 (fixtures)


# ------------------------------------------------------------ error paths
@pytest.mark.parametrize("var", [
    "VLLM_SPYRE_WARMUP_PROMPT_LENS",
    "VLLM_SPYRE_WARMUP_NEW_TOKENS",
    "VLLM_SPYRE_WARMUP_BATCH_SIZES",
])
@pytest.mark.parametrize("bad_item, raw_tail", [
    ("abc", "abc"),
    ("1.5", "1.5"),
    ("", ""),  # trailing comma
])
def test_non_integer_is_rejected(no_sendnn, var, bad_item, raw_tail):
    good = {
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64",
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": "20",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": "1",
    }
    raw = f"{good[var]},{raw_tail}"
    env = dict(good, **{var: raw})
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ=env)
    msg = str(exc.value)
    assert msg.startswith(f"{var}={raw!r} is invalid")
    assert f"{bad_item!r} is not an integer" in msg
    assert "comma-separated list of positive integers" in msg


@pytest.mark.parametrize("var", [
    "VLLM_SPYRE_WARMUP_PROMPT_LENS",
    "VLLM_SPYRE_WARMUP_NEW_TOKENS",
    "VLLM_SPYRE_WARMUP_BATCH_SIZES",
])
@pytest.mark.parametrize("value", [0, -64])
def test_zero_and_negative_are_rejected(no_sendnn, var, value):
    env = dict(shapes_env("64", "20", "1"), **{var: str(value)})
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ=env)
    msg = str(exc.value)
    assert msg.startswith(f"{var}={str(value)!r} is invalid")
    assert f"{value} is not a positive integer" in msg


def test_unequal_list_lengths_are_rejected(no_sendnn):
    env = shapes_env("64,128", "20", "1,2,4")
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ=env)
    msg = str(exc.value)
    assert "must have equal length" in msg
    assert "VLLM_SPYRE_WARMUP_PROMPT_LENS has 2" in msg
    assert "VLLM_SPYRE_WARMUP_NEW_TOKENS has 1" in msg
    assert "VLLM_SPYRE_WARMUP_BATCH_SIZES has 3" in msg


def test_unequal_lengths_with_defaults_for_other_lists(no_sendnn):
    # Only the prompt lengths are set: the other lists default to one entry.
    with pytest.raises(ValueError, match="must have equal length"):
        SpyreConfig.from_env(
            environ={"VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,128"})


@pytest.mark.parametrize("raw, bad", [("100", 100), ("64, 96", 96),
                                      ("32", 32), ("65", 65)])
def test_prompt_len_not_multiple_of_64(no_sendnn, raw, bad):
    n = len(raw.split(","))
    env = shapes_env(raw, ",".join(["20"] * n), ",".join(["1"] * n))
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ=env)
    msg = str(exc.value)
    assert msg.startswith(f"VLLM_SPYRE_WARMUP_PROMPT_LENS={raw!r} is invalid")
    assert f"{bad} is not a multiple of 64" in msg


def test_new_tokens_need_not_be_multiple_of_64(no_sendnn):
    cfg = SpyreConfig.from_env(environ=shapes_env("192", "3", "5"))
    assert cfg.warmup_shapes == (WarmupShape(192, 3, 5), )


@pytest.mark.parametrize("backend", ["cuda", "INDUCTOR", "", "aot_eager"])
def test_bad_backend_name(no_sendnn, backend):
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ={"VLLM_SPYRE_DYNAMO_BACKEND": backend})
    msg = str(exc.value)
    assert f"VLLM_SPYRE_DYNAMO_BACKEND={backend!r} is invalid" in msg
    assert "choose one of eager, inductor, sendnn" in msg


def test_sendnn_without_torch_sendnn(no_sendnn):
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ={"VLLM_SPYRE_DYNAMO_BACKEND": "sendnn"})
    msg = str(exc.value)
    assert "VLLM_SPYRE_DYNAMO_BACKEND=sendnn" in msg
    assert "torch_sendnn" in msg
    assert "not installed" in msg
    assert "inductor or eager" in msg


@pytest.mark.parametrize("value", ["2", "yes", "true", "", "-1"])
def test_bad_use_cb_value(no_sendnn, value):
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ={"VLLM_SPYRE_USE_CB": value})
    msg = str(exc.value)
    assert f"VLLM_SPYRE_USE_CB={value!r} is invalid" in msg
    assert "0 (static batching)" in msg
    assert "1 (continuous batching)" in msg


@pytest.mark.parametrize("value", ["2", "yes", "", "on"])
def test_bad_native_kernels_value(no_sendnn, value):
    with pytest.raises(ValueError) as exc:
        SpyreConfig.from_env(environ={"VLLM_SPYRE_NATIVE_KERNELS": value})
    msg = str(exc.value)
    assert f"VLLM_SPYRE_NATIVE_KERNELS={value!r} is invalid" in msg
    assert "1 (the C++ kernels where they build)" in msg
    assert "0 (PyTorch's own ops)" in msg
