"""vllm/config/spyre_env_vars.py: every Spyre variable is declared once,
with a default that parses, and listed in the generated table."""
import re

from vllm.config.spyre import DYNAMO_BACKENDS, SpyreConfig
from vllm.config.spyre_env_vars import SPYRE_ENV_VARS, render_env_var_table

from spyre_env import no_sendnn  # noqa: F401 (fixture)


def test_render_env_var_table_lists_every_variable():
    table = render_env_var_table()
    lines = table.rstrip("\n").split("\n")
    assert lines[0] == "| Variable | Default | Meaning |"
    assert lines[1] == "|---|---|---|"
    assert len(lines) == 2 + len(SPYRE_ENV_VARS)
    for var, line in zip(SPYRE_ENV_VARS, lines[2:]):
        assert line.startswith(f"| `{var.name}` | {var.default_doc} | ")
        assert var.help in line
    names = re.findall(r"^\| `(\w+)`", table, flags=re.M)
    assert {v.name for v in SPYRE_ENV_VARS} <= set(names)


def test_env_var_declarations_are_consistent(no_sendnn):
    names = [v.name for v in SPYRE_ENV_VARS]
    assert len(names) == len(set(names))
    assert set(names) == {
        "VLLM_SPYRE_DYNAMO_BACKEND",
        "VLLM_SPYRE_WARMUP_PROMPT_LENS",
        "VLLM_SPYRE_WARMUP_NEW_TOKENS",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES",
        "VLLM_SPYRE_USE_CB",
        "AIU_WORLD_SIZE",
        "SPYRE_DEVICES",
        "TORCH_SENDNN_CACHE_ENABLE",
        "TORCH_SENDNN_CACHE_DIR",
        "VLLM_SPYRE_REQUIRE_PRECOMPILED",
        "VLLM_SPYRE_INDUCTOR_FREEZING",
        "VLLM_SPYRE_NATIVE_KERNELS",
        "VLLM_SPYRE_GUIDED_MAX_REPEAT",
        "VLLM_SPYRE_GUIDED_MAX_DEPTH",
        "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S",
        "VLLM_SPYRE_GUIDED_MAX_BYTES",
    }
    # Every declared default parses: the defaults spelled out explicitly
    # give the same config as no environment at all.
    explicit = {v.name: v.default() for v in SPYRE_ENV_VARS}
    implicit_cfg = SpyreConfig.from_env(environ={})
    explicit_cfg = SpyreConfig.from_env(environ=explicit)
    assert explicit_cfg.warmup_shapes == implicit_cfg.warmup_shapes
    assert explicit_cfg.dynamo_backend == implicit_cfg.dynamo_backend
    assert implicit_cfg.dynamo_backend in DYNAMO_BACKENDS
    assert explicit_cfg.card_count is None and implicit_cfg.card_count is None
