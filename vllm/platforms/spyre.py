"""The Spyre platform: how vLLM finds and configures the Spyre backend.

``register`` is the ``vllm.platform_plugins`` entry point named ``spyre``:
vLLM calls it in every process (API server, MQLLMEngine, workers) to resolve
``current_platform``.  ``SpyrePlatform.check_and_update_config`` runs once, in
the process that builds the ``VllmConfig``: it parses the Spyre environment
variables, checks the model's family (``spyre_families``: architecture,
sliding window; ``spyre_encoder_families`` for pooling models), derives
the engine limits (from the warm-up shapes under static batching and for
pooling models, from vLLM's own flags under continuous batching) and
selects the Spyre executor, worker and scheduler of that mode
(``spyre_modes``, one function a mode), and stores the parsed settings in
``vllm_config.additional_config`` for every other process.

Choosing every mode's classes makes this module (with ``spyre_modes``) the
top of the project's layers (``pyproject.toml``'s import contract): it
imports them, at configuration time, and no other module imports it;
``is_spyre`` lives with the settings, at the bottom.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

import torch

from vllm.compilation.spyre_sendnn import sendnn_available
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.spyre import SpyreConfig

logger = init_logger(__name__)

#: vLLM's own switches for its usage statistics; any one of them set is the
#: user's choice, which the platform keeps.
USAGE_STATS_ENV_VARS = ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
                        "DO_NOT_TRACK")
SPYRE_ATTN_BACKEND_CLS = \
    "vllm.attention.backends.spyre_attn.SpyreAttentionBackend"
SPYRE_PUNICA_WRAPPER_CLS = \
    "vllm.lora.punica_wrapper.spyre_punica.PunicaWrapperSpyre"
SPYRE_COMMUNICATOR_CLS = ("vllm.distributed.device_communicators."
                          "spyre_communicator.SpyreCommunicator")


def register() -> Optional[str]:
    """Entry point of the ``vllm.platform_plugins`` group: the qualified
    name of ``SpyrePlatform`` (``vllm.config.spyre.PLATFORM_QUALNAME``,
    which ``is_spyre`` compares with)."""
    return f"{__name__}.{SpyrePlatform.__qualname__}"


class SpyrePlatform(Platform):
    _enum = PlatformEnum.OOT
    # Tensors live in host memory and the card is reached through
    # torch.compile, so vLLM and torch see a CPU device.
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        """The first entry is what ``dtype="auto"`` picks for a float32
        checkpoint: float16 on Spyre cards, float32 on the CPU stand-in,
        which has no float16 path (``auto`` takes float32 for a float16
        checkpoint; ``--dtype float16`` is refused)."""
        if sendnn_available():
            return [torch.float16, torch.float32, torch.bfloat16]
        return [torch.float32, torch.bfloat16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "spyre"

    @classmethod
    def is_async_output_supported(cls, enforce_eager: Optional[bool]) -> bool:
        return False

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        # no_grad, not inference_mode: compiled graphs guard on the dispatch
        # keys of their inputs, and warm-up runs under no_grad as well.
        return torch.no_grad()

    @classmethod
    def supports_v1(cls, model_config) -> bool:
        return False

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, head_size: int,
                             dtype: torch.dtype,
                             kv_cache_dtype: Optional[str], block_size: int,
                             use_v1: bool, use_mla: bool,
                             has_sink: bool) -> str:
        """vLLM's model code (``--model-impl vllm``) attends through the
        Spyre backend, over the caches and kernels the FMS path uses."""
        if use_mla:
            raise NotImplementedError(
                "Multi-head latent attention (MLA) is not supported on Spyre")
        return SPYRE_ATTN_BACKEND_CLS

    @classmethod
    def get_punica_wrapper(cls) -> str:
        """LoRA's products inside the compiled graphs (``spyre_punica``)."""
        return SPYRE_PUNICA_WRAPPER_CLS

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """vLLM's base communicator with an ``all_gather`` gloo has."""
        return SPYRE_COMMUNICATOR_CLS

    @classmethod
    def use_all_gather(cls) -> bool:
        """vLLM's logits processor gathers a tensor-parallel model's
        logits on every rank (the runners read them on every rank, as FMS's
        head gives them), through ``SpyreCommunicator``'s gloo gather."""
        return True

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        """Only the methods ``spyre_quant`` reads: vLLM's other kernels
        (AWQ, Marlin, bitsandbytes, ...) are CUDA's."""
        from vllm.model_executor.layers.quantization import spyre_quant
        if quant != spyre_quant.NAME:
            raise ValueError(
                f"{quant} quantization is not supported on Spyre. Supported "
                f"quantization: {spyre_quant.SUPPORTED}.")

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil
        return psutil.virtual_memory().total

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        """Apply the Spyre settings to the vLLM config (API process only)."""
        # Imported here: importing any module of vllm.config runs upstream's
        # vllm/config/__init__.py, which resolves the platform, this class;
        # vllm.model_executor imports vllm.config as well.
        from vllm.config.spyre import ADDITIONAL_CONFIG_KEY, SpyreConfig
        from vllm.config.spyre_model_facts import SpyreModelFacts
        from vllm.platforms import spyre_modes
        if ADDITIONAL_CONFIG_KEY in (vllm_config.additional_config or {}):
            # Applied already: a vision-language model's config copied
            # for its language model (``VllmConfig.with_hf_config``).
            return
        model_config = vllm_config.model_config
        pooling = (model_config is not None
                   and model_config.runner_type == "pooling")
        spyre = SpyreConfig.from_env(pooling=pooling)
        logger.info("Spyre torch.compile backend: %s (%s)",
                    spyre.dynamo_backend, spyre.backend_reason)
        if usage_stats_unset():
            # Before the engine (and its process) exists, so it reads this.
            os.environ["VLLM_NO_USAGE_STATS"] = "1"
            logger.info(
                "vLLM usage statistics are off on Spyre: collecting them "
                "takes a core while the first batch runs, and the server "
                "makes no network calls (VLLM_NO_USAGE_STATS=0 keeps them).")

        parallel_config = vllm_config.parallel_config

        tp_before = parallel_config.tensor_parallel_size
        spyre_modes.configure_parallel(parallel_config, spyre)
        if model_config is not None and \
                parallel_config.tensor_parallel_size != tp_before:
            # vLLM checked the head counts against the flag's size only.
            model_config.verify_with_parallel_config(parallel_config)
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = spyre_modes.SPYRE_STATIC_WORKER_CLS

        if model_config is None:
            return
        if model_config.runner_type not in ("generate", "pooling"):
            raise NotImplementedError(
                f"The {model_config.runner_type!r} runner is not supported on "
                "Spyre; text generation and pooling (embeddings, scores) "
                "are.")
        if spyre.dynamo_backend != "sendnn" and \
                model_config.dtype == torch.float16:
            raise ValueError(
                f"--dtype float16 is not supported with "
                f"VLLM_SPYRE_DYNAMO_BACKEND={spyre.dynamo_backend}: the CPU "
                "backends serve float32 and bfloat16 (--dtype bfloat16 "
                "halves the bytes a decode step reads).")
        if model_config.enable_prompt_embeds:
            # The compiled graphs take token ids: embeddings would be
            # replaced by the placeholder ids vLLM stores for them.
            raise NotImplementedError(
                "--enable-prompt-embeds is not supported on Spyre")
        if pooling:
            if vllm_config.lora_config is not None:
                raise NotImplementedError(
                    "LoRA adapters on pooling models are not supported on "
                    "Spyre")
            if model_config.quantization is not None:
                raise NotImplementedError(
                    f"Quantized pooling models ({model_config.quantization})"
                    " are not supported on Spyre; the encoders of "
                    "spyre_encoder_families load float checkpoints")
            from vllm.model_executor.models.spyre_model_impl import \
                flag_value
            impl = flag_value(model_config.model_impl)
            if impl != "auto":
                raise NotImplementedError(
                    f"--model-impl {impl} for pooling models is not "
                    "supported on Spyre: they run the encoders of "
                    "spyre_encoder_families (--model-impl auto)")
            from vllm.model_executor.models.spyre_encoder_families import (
                check_parallel, encoder_family)
            check_parallel(encoder_family(model_config.hf_config),
                           parallel_config.tensor_parallel_size)
            spyre_modes.configure_pooling(vllm_config, spyre)
        else:
            impl = _choose_model_impl(model_config, spyre)
            from vllm.lora import spyre_lora
            spyre_lora.check_config(vllm_config, impl, spyre.dynamo_backend)
            _check_tensor_parallel(model_config, impl,
                                   parallel_config.tensor_parallel_size)
            hybrid = _check_hybrid(model_config.hf_config,
                                   vllm_config.cache_config)
            if spyre.use_cb:
                spyre_modes.configure_continuous_batching(vllm_config,
                                                          spyre)
            else:
                spyre_modes.configure_static_batching(vllm_config, spyre)
            spyre_modes.configure_speculative(vllm_config, spyre, hybrid)
            spyre_modes.configure_images(vllm_config, spyre)
            _store_draft_facts(vllm_config, spyre)
            facts = SpyreModelFacts(
                model_impl=impl,
                sliding_window=_sliding_window(model_config.hf_config, impl)
                or 0)
            facts.store(vllm_config)
            _log_sliding_window(facts.sliding_window,
                                model_config.max_model_len)
        # The Spyre attention ops apply a sliding window themselves, over
        # caches laid out by this backend, which keep every token: vLLM's
        # block manager must not manage blocks for a window (left set, it
        # made a Mistral decode other tokens than transformers).
        vllm_config.cache_config.sliding_window = None
        model_config.enforce_eager = True
        # Tensors stay on the "cpu" torch device, but the KV blocks are the
        # card's: vLLM's engine swaps its device and host cache statistics
        # (vllm:gpu_cache_usage_perc) for a device type of "cpu", after its
        # CPU worker's convention.
        vllm_config.device_config.device_type = "spyre"

        extra = dict(vllm_config.additional_config or {})
        extra[ADDITIONAL_CONFIG_KEY] = spyre.to_dict()
        vllm_config.additional_config = extra


def _check_tensor_parallel(model_config, impl: str, size: int) -> None:
    """Refuses, before any rank starts, a tensor-parallel size that does
    not split the decoder's heads, MLP, experts or vocabulary
    (``spyre_tp_dims``), naming the sizes that do."""
    from vllm.config.spyre_model_facts import VLLM
    from vllm.model_executor.models import spyre_tp_dims
    if impl == VLLM:
        dims = spyre_tp_dims.vllm_dims(model_config.hf_text_config)
    else:
        from vllm.model_executor.models.spyre_families import family_of
        hf_config = model_config.hf_config
        dims = family_of(hf_config).tp_dims(hf_config)
    spyre_tp_dims.check(dims, size)


def _choose_model_impl(model_config, spyre: SpyreConfig) -> str:
    """The decoder's model code from ``--model-impl`` and the architecture
    (``spyre_model_impl.resolve``); an architecture neither runs is
    refused here, before anything loads."""
    from vllm.model_executor.models import spyre_model_impl
    quantized = model_config.quantization is not None
    impl, arch = spyre_model_impl.resolve(model_config.model_impl,
                                          model_config.hf_config, quantized)
    if quantized and spyre.dynamo_backend == "sendnn":
        raise NotImplementedError(
            f"Quantized checkpoints ({model_config.quantization}) run on the "
            "CPU backends (VLLM_SPYRE_DYNAMO_BACKEND=eager or inductor), not "
            "yet on the card (sendnn), whose FMS gptq/fp8 linear types are "
            "not wired in")
    if impl == spyre_model_impl.VLLM and spyre.dynamo_backend == "sendnn":
        # Not yet run on the card: its graphs (attention included) have
        # only been compiled for the CPU backends.
        raise NotImplementedError(
            f"vLLM's model code (here for {arch}) runs on the CPU backends "
            "(VLLM_SPYRE_DYNAMO_BACKEND=eager or inductor), not yet on the "
            "card (sendnn); on the card use FMS's model code (--model-impl "
            "auto) and an architecture FMS has")
    logger.info(
        "Spyre model implementation: %s for %s (--model-impl %s)",
        "FMS" if impl == spyre_model_impl.FMS else "vLLM", arch,
        spyre_model_impl.flag_value(model_config.model_impl))
    return impl


def _store_draft_facts(vllm_config, spyre: SpyreConfig) -> None:
    """A speculative draft model's model code and sliding window, chosen
    as the served model's are, by the same ``--model-impl``, beside them
    (``SpyreModelFacts.DRAFT_KEY``); nothing without a draft model."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    from vllm.config.spyre_model_facts import SpyreModelFacts
    draft = spec.draft_model_config
    # vLLM builds the draft's model config without the served model's flag.
    draft.model_impl = vllm_config.model_config.model_impl
    impl = _choose_model_impl(draft, spyre)
    if _check_hybrid(draft.hf_config, vllm_config.cache_config):
        raise NotImplementedError(
            f"A hybrid (Mamba-2 and attention) draft model ({draft.model}) "
            "is not supported on Spyre")
    SpyreModelFacts(
        model_impl=impl,
        sliding_window=_sliding_window(draft.hf_config, impl) or 0).store(
            vllm_config, SpyreModelFacts.DRAFT_KEY)


def _check_hybrid(hf_config, cache_config) -> bool:
    """A hybrid (Mamba-2 and attention) model runs its Mamba-2 layers over
    Spyre's state slots (``spyre_mamba``), without prefix caching, whose
    cached blocks would hold keys and values but no state.  Whether the
    model is one."""
    from vllm.model_executor.models.spyre_families import FAMILIES, family_of
    if not any(a in FAMILIES for a in hf_config.architectures or []):
        return False
    family = family_of(hf_config)
    if family.hybrid and cache_config.enable_prefix_caching:
        raise NotImplementedError(
            f"Prefix caching of {family.hf_architecture} is not supported on "
            "Spyre: a cached prefix would hold its attention layers' keys "
            "and values but not its Mamba-2 layers' states; drop "
            "--enable-prefix-caching")
    return family.hybrid


def _sliding_window(hf_config, model_impl: str) -> Optional[int]:
    """The window a decoder's attention slides over, if any: the FMS
    family's, or for vLLM's model code the config's own."""
    from vllm.config.spyre_model_facts import FMS
    from vllm.model_executor.models.spyre_families import (family_of,
                                                           window_of)
    if model_impl == FMS:
        return family_of(hf_config).sliding_window(hf_config)
    # A vision-language model's window is its language model's.
    return window_of(getattr(hf_config, "text_config", None) or hf_config)


def _log_sliding_window(window: int, max_model_len: int) -> None:
    """Says when a model's sliding window drops tokens of long sequences
    (the attention ops apply it; the caches keep every token)."""
    if 0 < window < max_model_len:
        logger.info(
            "Sliding-window attention: each token attends to the last %d "
            "tokens (max_model_len=%d); the key/value cache keeps every "
            "token", window, max_model_len)


def usage_stats_unset(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when none of vLLM's usage-statistics switches is set.

    vLLM collects its usage statistics in a thread that starts when the
    engine is ready: it runs a Python subprocess to identify the CPU and
    then posts the result to a server.  On Spyre's CPU path that takes a
    core for about a second, just as the first batch runs, which made the
    first batch after start-up up to twice as slow as the next; and a
    Spyre server makes no network calls at run time.  So the platform turns
    the statistics off unless the user has chosen (``VLLM_NO_USAGE_STATS=0``
    keeps them on)."""
    env = os.environ if environ is None else environ
    return not any(name in env for name in USAGE_STATS_ENV_VARS)
