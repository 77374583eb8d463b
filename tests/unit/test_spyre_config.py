"""Unit tests of vllm/config/spyre.py (no model, no engine).
Settings that are refused are in test_spyre_config_errors.py."""
import json
import pickle
import re

import pytest

from vllm.compilation import spyre_sendnn
from vllm.platforms import spyre as spyre_platform
from vllm.config.spyre import (ADDITIONAL_CONFIG_KEY, SPYRE_ENV_VARS,
                               SpyreConfig)
from vllm.worker import spyre_heap
from vllm.config.spyre_warmup_shapes import (WarmupShape,
                                             parse_warmup_shapes)

from spyre_env import (no_sendnn, shapes_env,  # noqa: F401 (fixtures)
                       with_sendnn)


# ---------------------------------------------------------------- defaults
def test_defaults_without_torch_sendnn(no_sendnn):
    cfg = SpyreConfig.from_env(environ={})
    assert cfg.warmup_shapes == (WarmupShape(64, 20, 1), )
    assert cfg.dynamo_backend == "inductor"
    assert cfg.backend_reason == "default: torch_sendnn is not installed"
    assert cfg.use_cb is False


def test_default_backend_is_sendnn_where_torch_sendnn_imports(with_sendnn):
    cfg = SpyreConfig.from_env(environ={})
    assert cfg.dynamo_backend == "sendnn"
    assert cfg.backend_reason == "default: torch_sendnn is importable"


def test_default_backend_follows_real_sendnn_availability():
    cfg = SpyreConfig.from_env(environ={})
    if spyre_sendnn.sendnn_available():
        assert cfg.dynamo_backend == "sendnn"
    else:
        assert cfg.dynamo_backend == "inductor"
        assert "not installed" in cfg.backend_reason


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_explicit_backend_and_reason(no_sendnn, backend):
    cfg = SpyreConfig.from_env(
        environ={"VLLM_SPYRE_DYNAMO_BACKEND": f"  {backend} "})
    assert cfg.dynamo_backend == backend
    assert cfg.backend_reason == "set by VLLM_SPYRE_DYNAMO_BACKEND"


def test_explicit_sendnn_with_torch_sendnn(with_sendnn):
    cfg = SpyreConfig.from_env(environ={"VLLM_SPYRE_DYNAMO_BACKEND": "sendnn"})
    assert cfg.dynamo_backend == "sendnn"
    assert cfg.backend_reason == "set by VLLM_SPYRE_DYNAMO_BACKEND"


def test_explicit_use_cb_zero_is_static_batching(no_sendnn):
    cfg = SpyreConfig.from_env(environ={"VLLM_SPYRE_USE_CB": " 0 "})
    assert cfg.use_cb is False


def test_from_env_without_environ_reads_os_environ(monkeypatch, no_sendnn):
    for var in SPYRE_ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("VLLM_SPYRE_WARMUP_PROMPT_LENS", "128")
    monkeypatch.setenv("VLLM_SPYRE_WARMUP_NEW_TOKENS", "7")
    monkeypatch.setenv("VLLM_SPYRE_WARMUP_BATCH_SIZES", "3")
    cfg = SpyreConfig.from_env()
    assert cfg.dynamo_backend == "eager"
    assert cfg.warmup_shapes == (WarmupShape(128, 7, 3), )


def test_explicit_environ_ignores_os_environ(monkeypatch, no_sendnn):
    monkeypatch.setenv("VLLM_SPYRE_WARMUP_PROMPT_LENS", "128")
    monkeypatch.setenv("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
    cfg = SpyreConfig.from_env(environ={})
    assert cfg.warmup_shapes == (WarmupShape(64, 20, 1), )
    assert cfg.dynamo_backend == "inductor"


# ----------------------------------------------------------------- parsing
def test_comma_lists_with_spaces(no_sendnn):
    cfg = SpyreConfig.from_env(environ=shapes_env(
        " 64 , 128,  256 ", "20 ,10 , 5", "1,  2 ,4 "))
    assert cfg.warmup_shapes == (
        WarmupShape(64, 20, 1),
        WarmupShape(128, 10, 2),
        WarmupShape(256, 5, 4),
    )


def test_shapes_are_sorted():
    shapes = parse_warmup_shapes("256,64,128,64", "5,20,10,8", "4,1,2,2")
    assert shapes == (
        WarmupShape(64, 8, 2),
        WarmupShape(64, 20, 1),
        WarmupShape(128, 10, 2),
        WarmupShape(256, 5, 4),
    )
    assert isinstance(shapes, tuple)


def test_duplicate_shapes_are_removed():
    shapes = parse_warmup_shapes("128,64,128,64", "10,20,10,20", "2,1,2,1")
    assert shapes == (WarmupShape(64, 20, 1), WarmupShape(128, 10, 2))


def test_same_prompt_len_different_other_fields_are_kept():
    shapes = parse_warmup_shapes("64,64,64", "20,20,10", "1,2,1")
    assert shapes == (
        WarmupShape(64, 10, 1),
        WarmupShape(64, 20, 1),
        WarmupShape(64, 20, 2),
    )


def test_warmup_shape_properties_and_str():
    s = WarmupShape(prompt_len=128, new_tokens=16, batch_size=4)
    assert s.max_len == 144
    assert s.cost == (4 * 128, 128, 16, 4)
    assert str(s) == "(prompt_len=128, new_tokens=16, batch_size=4)"


def test_use_cb_one_selects_continuous_batching(no_sendnn):
    cfg = SpyreConfig.from_env(environ={"VLLM_SPYRE_USE_CB": " 1 "})
    assert cfg.use_cb is True
    assert cfg.warmup_shapes == ()
    assert cfg.ignored_vars == ()
    assert cfg.dynamo_backend == "inductor"


def test_static_batching_ignores_nothing(no_sendnn):
    cfg = SpyreConfig.from_env(environ=shapes_env("128", "8", "2"))
    assert cfg.use_cb is False
    assert cfg.ignored_vars == ()


def test_use_cb_lists_the_warmup_vars_it_ignores(no_sendnn):
    env = {"VLLM_SPYRE_USE_CB": "1",
           "VLLM_SPYRE_WARMUP_BATCH_SIZES": "4",
           "VLLM_SPYRE_WARMUP_PROMPT_LENS": "128"}
    cfg = SpyreConfig.from_env(environ=env)
    assert cfg.warmup_shapes == ()
    # In declaration order, whatever the order of the environment.
    assert cfg.ignored_vars == ("VLLM_SPYRE_WARMUP_PROMPT_LENS",
                                "VLLM_SPYRE_WARMUP_BATCH_SIZES")
    every = dict(shapes_env("64", "20", "1"), VLLM_SPYRE_USE_CB="1")
    assert SpyreConfig.from_env(environ=every).ignored_vars == (
        "VLLM_SPYRE_WARMUP_PROMPT_LENS", "VLLM_SPYRE_WARMUP_NEW_TOKENS",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES")


def test_use_cb_does_not_parse_the_ignored_warmup_vars(no_sendnn):
    # Values static batching would reject are only reported as ignored.
    env = shapes_env("100", "x", "1,2", VLLM_SPYRE_USE_CB="1")
    cfg = SpyreConfig.from_env(environ=env)
    assert cfg.use_cb is True and cfg.warmup_shapes == ()
    assert len(cfg.ignored_vars) == 3


def test_use_cb_still_validates_the_other_vars(no_sendnn):
    with pytest.raises(ValueError, match="VLLM_SPYRE_DYNAMO_BACKEND='cuda'"):
        SpyreConfig.from_env(environ={"VLLM_SPYRE_USE_CB": "1",
                                      "VLLM_SPYRE_DYNAMO_BACKEND": "cuda"})
    with pytest.raises(ValueError, match="AIU_WORLD_SIZE='0'"):
        SpyreConfig.from_env(environ={"VLLM_SPYRE_USE_CB": "1",
                                      "AIU_WORLD_SIZE": "0"})


def test_every_field_reaches_the_workers():
    """Each field set away from its default survives ``to_dict`` /
    ``from_dict`` (the vLLM config's copy the workers read)."""
    from dataclasses import MISSING, fields
    cfg = SpyreConfig(
        dynamo_backend="eager", warmup_shapes=(WarmupShape(64, 4, 2), ),
        use_cb=True, backend_reason="reason", world_size=2,
        devices=("0", "1"), ignored_vars=("VLLM_SPYRE_WARMUP_NEW_TOKENS", ),
        graph_cache_dir="/tmp/g", require_precompiled=True,
        inductor_freezing=False, native_kernels=False, pooling=True,
        guided_max_repeat=100, guided_max_depth=8, guided_max_bytes=5000,
        guided_compile_timeout_s=2.5)
    # A field added later must be set here too.
    assert all(getattr(cfg, f.name) != f.default for f in fields(cfg)
               if f.default is not MISSING)
    assert SpyreConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_use_cb_round_trip(no_sendnn):
    env = {"VLLM_SPYRE_USE_CB": "1", "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
           "VLLM_SPYRE_WARMUP_NEW_TOKENS": "20", "SPYRE_DEVICES": "0,1"}
    cfg = SpyreConfig.from_env(environ=env)
    d = cfg.to_dict()
    assert d["use_cb"] is True
    assert d["warmup_shapes"] == ()
    assert d["ignored_vars"] == ("VLLM_SPYRE_WARMUP_NEW_TOKENS", )
    back = SpyreConfig.from_dict(d)
    assert back == cfg
    assert back.use_cb is True
    assert back.ignored_vars == ("VLLM_SPYRE_WARMUP_NEW_TOKENS", )
    via_json = SpyreConfig.from_dict(json.loads(json.dumps(d)))
    assert via_json == cfg  # JSON turns the tuples into lists
    assert SpyreConfig.from_dict(pickle.loads(pickle.dumps(d))) == cfg


# ---------------------------------------------------------- derived limits
def test_derived_limits_single_default_shape(no_sendnn):
    cfg = SpyreConfig.from_env(environ={})
    assert cfg.max_model_len == 84
    assert cfg.max_num_seqs == 1
    assert cfg.max_num_batched_tokens == 64


def test_derived_limits_take_maxima_over_different_shapes(no_sendnn):
    # Each limit is reached by a different shape.
    cfg = SpyreConfig.from_env(
        environ=shapes_env("64,128,256", "200,10,5", "8,6,2"))
    assert cfg.max_model_len == max(64 + 200, 128 + 10, 256 + 5)  # 264
    assert cfg.max_model_len == 264
    assert cfg.max_num_seqs == 8
    assert cfg.max_num_batched_tokens == max(8 * 64, 6 * 128, 2 * 256)
    assert cfg.max_num_batched_tokens == 768


def test_validate_model_len_accepts_exact_fit():
    cfg = SpyreConfig("eager", (WarmupShape(64, 20, 1),
                                WarmupShape(128, 16, 2)))
    cfg.validate_model_len(144)  # 128 + 16 == 144: fits exactly
    cfg.validate_model_len(4096)


def test_validate_model_len_error_message():
    cfg = SpyreConfig("eager", (WarmupShape(64, 20, 1),
                                WarmupShape(128, 16, 2)))
    with pytest.raises(ValueError) as exc:
        cfg.validate_model_len(143)
    msg = str(exc.value)
    assert ("Warm-up shape (prompt_len=128, new_tokens=16, batch_size=2) "
            "needs 144 tokens") in msg
    assert "maximum length of 143" in msg
    assert "VLLM_SPYRE_WARMUP_PROMPT_LENS" in msg
    assert "VLLM_SPYRE_WARMUP_NEW_TOKENS" in msg


def test_validate_model_len_reports_first_too_long_shape():
    cfg = SpyreConfig("eager", (WarmupShape(64, 20, 1),
                                WarmupShape(128, 16, 2)))
    with pytest.raises(ValueError) as exc:
        cfg.validate_model_len(80)
    assert "prompt_len=64, new_tokens=20" in str(exc.value)
    assert "needs 84 tokens" in str(exc.value)


# ------------------------------------------------------------- transport
def test_to_dict_from_dict_round_trip(no_sendnn):
    cfg = SpyreConfig.from_env(environ=shapes_env(
        "128,64", "10,20", "2,1", VLLM_SPYRE_DYNAMO_BACKEND="eager"))
    d = cfg.to_dict()
    assert d["dynamo_backend"] == "eager"
    assert d["use_cb"] is False
    assert d["backend_reason"] == "set by VLLM_SPYRE_DYNAMO_BACKEND"
    assert [dict(s) for s in d["warmup_shapes"]] == [
        {"prompt_len": 64, "new_tokens": 20, "batch_size": 1},
        {"prompt_len": 128, "new_tokens": 10, "batch_size": 2},
    ]
    back = SpyreConfig.from_dict(d)
    assert back == cfg
    assert isinstance(back.warmup_shapes, tuple)
    assert all(isinstance(s, WarmupShape) for s in back.warmup_shapes)


def test_round_trip_through_json_and_pickle(no_sendnn):
    cfg = SpyreConfig.from_env(environ=shapes_env("64,192", "20,4", "4,1"))
    via_json = SpyreConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert via_json == cfg
    via_pickle = SpyreConfig.from_dict(pickle.loads(pickle.dumps(
        cfg.to_dict())))
    assert via_pickle == cfg


def test_from_vllm_config():

    class FakeVllmConfig:
        additional_config = None

    cfg = SpyreConfig("inductor", (WarmupShape(64, 20, 1), ))
    fake = FakeVllmConfig()
    with pytest.raises(RuntimeError, match="carries no Spyre settings"):
        SpyreConfig.from_vllm_config(fake)
    fake.additional_config = {ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    assert SpyreConfig.from_vllm_config(fake) == cfg


def test_config_is_frozen():
    cfg = SpyreConfig("eager", (WarmupShape(64, 20, 1), ))
    with pytest.raises(Exception):
        cfg.dynamo_backend = "inductor"  # type: ignore[misc]


# ------------------------------------------------------------ card count
def test_card_count_from_environment(no_sendnn):
    assert SpyreConfig.from_env(environ={}).card_count is None
    assert SpyreConfig.from_env(
        environ={"AIU_WORLD_SIZE": "4"}).card_count == 4
    cfg = SpyreConfig.from_env(environ={"SPYRE_DEVICES": "3, 5"})
    assert cfg.card_count == 2 and cfg.devices == ("3", "5")
    assert SpyreConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("env,needle", [
    ({"AIU_WORLD_SIZE": "0"}, "AIU_WORLD_SIZE='0'"),
    ({"AIU_WORLD_SIZE": "two"}, "AIU_WORLD_SIZE='two'"),
    ({"AIU_WORLD_SIZE": "2,2"}, "one positive integer"),
    ({"SPYRE_DEVICES": "0,0"}, "listed twice"),
    ({"AIU_WORLD_SIZE": "3", "SPYRE_DEVICES": "0,1"}, "fewer than"),
])
def test_card_settings_errors(no_sendnn, env, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SpyreConfig.from_env(environ=env)


def test_tensor_parallel_reconciliation(no_sendnn):
    cfg = SpyreConfig.from_env(environ={"AIU_WORLD_SIZE": "2"})
    assert cfg.validate_tensor_parallel(1, tp_given=False) == 2
    assert cfg.validate_tensor_parallel(2, tp_given=True) == 2
    with pytest.raises(ValueError) as err:
        cfg.validate_tensor_parallel(4, tp_given=True)
    assert "--tensor-parallel-size 4" in str(err.value)
    assert "AIU_WORLD_SIZE" in str(err.value)
    plain = SpyreConfig.from_env(environ={})
    assert plain.validate_tensor_parallel(3, tp_given=True) == 3



# ---------------------------------------------------------- usage statistics

@pytest.mark.parametrize("env, unset", [
    ({}, True),
    ({"VLLM_SPYRE_USE_CB": "1"}, True),
    ({"VLLM_NO_USAGE_STATS": "0"}, False),
    ({"VLLM_NO_USAGE_STATS": "1"}, False),
    ({"VLLM_DO_NOT_TRACK": "1"}, False),
    ({"DO_NOT_TRACK": "1"}, False),
])
def test_usage_stats_unset_only_without_any_switch(env, unset):
    assert spyre_platform.usage_stats_unset(env) is unset


@pytest.mark.parametrize("env, unset", [
    ({}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True),
    ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, False),
])
def test_malloc_threshold_unset_unless_the_user_tuned_it(env, unset):
    assert spyre_heap.malloc_threshold_unset(env) is unset
