"""Spyre settings: the one place where ``VLLM_SPYRE_*`` variables are read.

Every variable is declared once in ``SPYRE_ENV_VARS`` (name, default, help;
``spyre_env_vars``).
``SpyreConfig.from_env`` parses them once, in the API process, into a frozen
dataclass.  The platform stores it in ``vllm_config.additional_config`` so that
every engine and worker process receives the same values, pickled with the
rest of the vLLM config, and never reads the environment again.

The configuration page ``docs/configuration.md`` is generated from
``SPYRE_ENV_VARS`` by ``render_env_var_table``.  ``is_spyre`` tells any
module whether Spyre is vLLM's platform without importing the platform
module, which sits above every mode it configures.

It sits beside upstream's settings (``vllm/config/``) at the bottom of the
project's layers: every other Spyre module may read it, and it reads none
of them but the warm-up shape parsing and the ``torch_sendnn`` probe.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from vllm.compilation import spyre_sendnn
# The declarations are re-exported: every module reads settings from here.
from vllm.config.spyre_env_vars import (CB_BLOCK_SIZE,  # noqa: F401
                                        ENV_BY_NAME, SPYRE_ENV_VARS, EnvVar,
                                        render_env_var_table)
from vllm.config.spyre_warmup_shapes import (  # noqa: F401
    PROMPT_LEN_MULTIPLE, WarmupShape, parse_int_list, parse_pooling_shapes,
    parse_warmup_shapes)

DYNAMO_BACKENDS = ("eager", "inductor", "sendnn")
#: Settings that only static batching reads.
WARMUP_ENV_VARS = ("VLLM_SPYRE_WARMUP_PROMPT_LENS",
                   "VLLM_SPYRE_WARMUP_NEW_TOKENS",
                   "VLLM_SPYRE_WARMUP_BATCH_SIZES")
#: Settings that pooling models do not read.
POOLING_IGNORED_ENV_VARS = ("VLLM_SPYRE_WARMUP_NEW_TOKENS",
                            "VLLM_SPYRE_USE_CB")
ADDITIONAL_CONFIG_KEY = "spyre"
#: The platform class that the ``spyre`` platform plugin activates.
PLATFORM_QUALNAME = "vllm.platforms.spyre.SpyrePlatform"


#: The structured-output limits, by their fields in ``SpyreConfig``.
GUIDED_LIMIT_VARS = (("guided_max_repeat", "VLLM_SPYRE_GUIDED_MAX_REPEAT"),
                     ("guided_max_depth", "VLLM_SPYRE_GUIDED_MAX_DEPTH"),
                     ("guided_max_bytes", "VLLM_SPYRE_GUIDED_MAX_BYTES"))


@dataclass(frozen=True)
class SpyreConfig:
    """Parsed and validated Spyre settings."""

    dynamo_backend: str
    warmup_shapes: tuple[WarmupShape, ...]
    use_cb: bool = False
    backend_reason: str = "set by VLLM_SPYRE_DYNAMO_BACKEND"
    #: Card count stated by the deployment (AIU_WORLD_SIZE), if any.
    world_size: Optional[int] = None
    #: Card ids visible to this server (SPYRE_DEVICES), one per rank.
    devices: tuple[str, ...] = ()
    #: Variables set in the environment that the chosen mode ignores.
    ignored_vars: tuple[str, ...] = ()
    #: Directory of the compiled-graph cache; None when it is off.
    graph_cache_dir: Optional[str] = None
    #: Refuse to start when a graph is missing from the cache.
    require_precompiled: bool = False
    #: inductor may freeze the weights into its graphs (cache off).
    inductor_freezing: bool = True
    #: The CPU backends may run on the project's C++ kernels.
    native_kernels: bool = True
    #: A pooling model (embeddings, scores): shapes generate no tokens.
    pooling: bool = False
    #: Structured output's bounds (``vllm.engine.spyre_guided_limits``).
    guided_max_repeat: int = 4096
    guided_max_depth: int = 64
    guided_max_bytes: int = 1 << 20
    guided_compile_timeout_s: float = 10.0

    @classmethod
    def from_env(cls,
                 environ: Optional[Mapping[str, str]] = None,
                 pooling: bool = False) -> "SpyreConfig":
        """Parse and validate every ``VLLM_SPYRE_*`` variable.

        ``pooling``: the model embeds or scores (vLLM's pooling runner), so
        its shapes are prompt lengths × batch sizes with no new tokens, and
        continuous batching does not apply.

        Raises ``ValueError`` naming the variable, the value and the rule.
        """
        env = os.environ if environ is None else environ

        def get(name: str) -> str:
            return env.get(name, ENV_BY_NAME[name].default()).strip()

        use_cb = get("VLLM_SPYRE_USE_CB")
        if use_cb not in ("0", "1"):
            raise ValueError(
                f"VLLM_SPYRE_USE_CB={use_cb!r} is invalid: use 0 (static "
                "batching) or 1 (continuous batching).")

        backend = get("VLLM_SPYRE_DYNAMO_BACKEND")
        if "VLLM_SPYRE_DYNAMO_BACKEND" in env:
            reason = "set by VLLM_SPYRE_DYNAMO_BACKEND"
        elif backend == "sendnn":
            reason = "default: torch_sendnn is importable"
        else:
            reason = "default: torch_sendnn is not installed"
        if backend not in DYNAMO_BACKENDS:
            raise ValueError(
                f"VLLM_SPYRE_DYNAMO_BACKEND={backend!r} is invalid: choose "
                f"one of {', '.join(DYNAMO_BACKENDS)}.")
        if backend == "sendnn" and not spyre_sendnn.sendnn_available():
            raise ValueError(
                "VLLM_SPYRE_DYNAMO_BACKEND=sendnn needs the torch_sendnn "
                "package, which is not installed; install it on a machine "
                "with Spyre cards, or set VLLM_SPYRE_DYNAMO_BACKEND to "
                "inductor or eager to run on the CPU.")

        if pooling:
            shapes = parse_pooling_shapes(
                get("VLLM_SPYRE_WARMUP_PROMPT_LENS"),
                get("VLLM_SPYRE_WARMUP_BATCH_SIZES"))
            ignored = tuple(n for n in POOLING_IGNORED_ENV_VARS if n in env)
            use_cb = "0"
        elif use_cb == "1":
            # Continuous batching compiles no per-shape graphs.
            shapes: tuple[WarmupShape, ...] = ()
            ignored = tuple(n for n in WARMUP_ENV_VARS if n in env)
        else:
            shapes = parse_warmup_shapes(
                get("VLLM_SPYRE_WARMUP_PROMPT_LENS"),
                get("VLLM_SPYRE_WARMUP_NEW_TOKENS"),
                get("VLLM_SPYRE_WARMUP_BATCH_SIZES"))
            ignored = ()
        world_size, devices = _parse_cards(get("AIU_WORLD_SIZE"),
                                           get("SPYRE_DEVICES"))
        cache_dir, strict = _parse_graph_cache(
            get("TORCH_SENDNN_CACHE_ENABLE"), get("TORCH_SENDNN_CACHE_DIR"),
            get("VLLM_SPYRE_REQUIRE_PRECOMPILED"), backend)
        freezing = _parse_switch(
            "VLLM_SPYRE_INDUCTOR_FREEZING", get("VLLM_SPYRE_INDUCTOR_FREEZING"),
            "1 (weights frozen into inductor's graphs) or 0 (weights graph "
            "inputs, updatable in place)")
        native = _parse_switch(
            "VLLM_SPYRE_NATIVE_KERNELS", get("VLLM_SPYRE_NATIVE_KERNELS"),
            "1 (the C++ kernels where they build) or 0 (PyTorch's own ops)")
        guided = {field: _parse_positive(name, get(name))
                  for field, name in GUIDED_LIMIT_VARS}
        guided["guided_compile_timeout_s"] = _parse_seconds(
            "VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S",
            get("VLLM_SPYRE_GUIDED_COMPILE_TIMEOUT_S"))
        return cls(dynamo_backend=backend,
                   warmup_shapes=shapes,
                   use_cb=use_cb == "1",
                   backend_reason=reason,
                   world_size=world_size,
                   devices=devices,
                   ignored_vars=ignored,
                   graph_cache_dir=cache_dir,
                   require_precompiled=strict,
                   inductor_freezing=freezing,
                   native_kernels=native,
                   pooling=pooling,
                   **guided)

    @property
    def card_count(self) -> Optional[int]:
        """Cards the environment asks for, if it says."""
        if self.world_size is not None:
            return self.world_size
        return len(self.devices) or None

    def validate_tensor_parallel(self, tp_size: int, tp_given: bool) -> int:
        """The tensor parallel size to use, reconciling the flag and the
        environment; raises ValueError naming both when they disagree."""
        cards = self.card_count
        if cards is None:
            return tp_size
        if tp_given and tp_size != cards:
            source = ("AIU_WORLD_SIZE" if self.world_size is not None else
                      "SPYRE_DEVICES")
            raise ValueError(
                f"--tensor-parallel-size {tp_size} disagrees with {source} "
                f"(which asks for {cards} card(s)); make them equal or "
                "drop one of them.")
        return cards

    # ---- derived limits -------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return max(s.max_len for s in self.warmup_shapes)

    @property
    def max_num_seqs(self) -> int:
        return max(s.batch_size for s in self.warmup_shapes)

    @property
    def max_num_batched_tokens(self) -> int:
        return max(s.batch_size * s.prompt_len for s in self.warmup_shapes)

    def validate_model_len(self, model_max_len: int) -> None:
        """Every shape must fit the model's maximum sequence length."""
        for s in self.warmup_shapes:
            if s.max_len > model_max_len:
                raise ValueError(
                    f"Warm-up shape {s} needs {s.max_len} tokens "
                    f"(prompt_len + new_tokens), more than the model's "
                    f"maximum length of {model_max_len}; lower "
                    "VLLM_SPYRE_WARMUP_PROMPT_LENS or "
                    "VLLM_SPYRE_WARMUP_NEW_TOKENS.")

    # ---- transport through vllm_config.additional_config ---------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpyreConfig":
        """The config ``to_dict`` gave (also after a JSON round trip, which
        turns tuples into lists); a field the dict lacks keeps its
        default."""
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["warmup_shapes"] = tuple(
            WarmupShape(**s) for s in data["warmup_shapes"])
        for name in ("devices", "ignored_vars"):
            values[name] = tuple(values.get(name, ()))
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "SpyreConfig":
        extra = vllm_config.additional_config or {}
        if ADDITIONAL_CONFIG_KEY not in extra:
            raise RuntimeError(
                "The vLLM config carries no Spyre settings: the Spyre "
                "platform's check_and_update_config did not run.")
        return cls.from_dict(extra[ADDITIONAL_CONFIG_KEY])


def _parse_switch(name: str, raw: str, meaning: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} is invalid: use {meaning}.")
    return raw == "1"


def _parse_positive(name: str, raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r} is invalid: give a positive "
                         "integer.")
    return int(raw)


def _parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r} is invalid: give a positive "
                         "number of seconds.")
    return value


def _parse_cards(world: str,
                 devices: str) -> tuple[Optional[int], tuple[str, ...]]:
    world_size = None
    if world:
        world_size = parse_int_list("AIU_WORLD_SIZE", world)
        if len(world_size) != 1:
            raise ValueError(f"AIU_WORLD_SIZE={world!r} is invalid: give "
                             "one positive integer.")
        world_size = world_size[0]
    cards = tuple(d.strip() for d in devices.split(",") if d.strip())
    if devices.strip() and len(set(cards)) != len(cards):
        raise ValueError(f"SPYRE_DEVICES={devices!r} is invalid: a card is "
                         "listed twice.")
    if world_size is not None and cards and len(cards) < world_size:
        raise ValueError(
            f"SPYRE_DEVICES={devices!r} lists {len(cards)} card(s), fewer "
            f"than AIU_WORLD_SIZE={world_size}.")
    return world_size, cards


def _parse_graph_cache(enable: str, directory: str, strict: str,
                       backend: str) -> tuple[Optional[str], bool]:
    """(cache directory or None, strict) from the three variables."""
    for name, value in (("TORCH_SENDNN_CACHE_ENABLE", enable),
                        ("VLLM_SPYRE_REQUIRE_PRECOMPILED", strict)):
        if value not in ("0", "1"):
            raise ValueError(f"{name}={value!r} is invalid: use 0 or 1.")
    if strict == "1" and enable != "1":
        raise ValueError(
            "VLLM_SPYRE_REQUIRE_PRECOMPILED=1 needs the graph cache: set "
            "TORCH_SENDNN_CACHE_ENABLE=1 (and TORCH_SENDNN_CACHE_DIR).")
    if strict == "1" and backend == "sendnn":
        raise ValueError(
            "VLLM_SPYRE_REQUIRE_PRECOMPILED=1 checks this project's graph "
            "cache, which the eager and inductor backends use; with sendnn "
            "the cache is torch_sendnn's own.")
    if enable != "1":
        return None, False
    if not directory:
        raise ValueError("TORCH_SENDNN_CACHE_ENABLE=1 needs a directory: "
                         "TORCH_SENDNN_CACHE_DIR is empty.")
    return os.path.abspath(os.path.expanduser(directory)), strict == "1"


def is_spyre() -> bool:
    """True when vLLM runs on the Spyre platform (its class compared by
    qualified name: the platform module is not imported)."""
    from vllm.platforms import current_platform
    cls = type(current_platform)
    return f"{cls.__module__}.{cls.__qualname__}" == PLATFORM_QUALNAME
