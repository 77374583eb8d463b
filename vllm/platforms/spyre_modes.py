"""How each Spyre mode sets vLLM's engine limits, worker and scheduler.

``SpyrePlatform.check_and_update_config`` (``spyre.py``) parses the
settings and checks the model, then calls one function here per mode:
static batching (limits from the warm-up shapes, one key/value block a
sequence), continuous batching (vLLM's own limits, blocks of
``CB_BLOCK_SIZE`` tokens, chunked prefill on request) or pooling (one pass
over the warm-up shapes, no key/value cache); and ``configure_parallel``
picks the tensor parallel size and the executor.  The workers, schedulers
and executors are named or imported here, at configuration time only:
this module sits just under the platform in the project's layers.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

from vllm.config.spyre import CB_BLOCK_SIZE, SpyreConfig
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

SPYRE_STATIC_WORKER_CLS = "vllm.worker.spyre_static_worker.SpyreStaticWorker"
SPYRE_CB_WORKER_CLS = "vllm.worker.spyre_cb_worker.SpyreCBWorker"
SPYRE_POOLING_WORKER_CLS = \
    "vllm.worker.spyre_pooling_worker.SpyrePoolingWorker"
SPYRE_SPEC_WORKER_CLS = "vllm.worker.spyre_spec_worker.SpyreSpecWorker"
#: The speculative methods Spyre runs.
SPEC_METHODS = ("ngram", "draft_model", "mlp_speculator")


def configure_static_batching(vllm_config: "VllmConfig",
                              spyre: SpyreConfig) -> None:
    """Engine limits from the warm-up shapes; one KV block per sequence."""
    model_config = vllm_config.model_config
    scheduler_config = vllm_config.scheduler_config
    cache_config = vllm_config.cache_config
    hf_max_len = _model_max_len(model_config.hf_text_config)
    if hf_max_len is not None:
        spyre.validate_model_len(hf_max_len)
    if cache_config.enable_prefix_caching:
        raise NotImplementedError(
            "Prefix caching needs continuous batching on Spyre: set "
            "VLLM_SPYRE_USE_CB=1, or drop --enable-prefix-caching.")

    max_model_len = spyre.max_model_len
    model_config.max_model_len = max_model_len
    scheduler_config.max_model_len = max_model_len
    scheduler_config.max_num_seqs = spyre.max_num_seqs
    scheduler_config.max_num_batched_tokens = max(
        spyre.max_num_batched_tokens, max_model_len)
    from vllm.core.spyre_static_scheduler import SpyreStaticScheduler
    _whole_prompts(scheduler_config,
                   functools.partial(SpyreStaticScheduler, spyre_config=spyre))
    # One KV "block" holds a whole sequence: there is no paging.
    cache_config.block_size = max_model_len
    logger.info(
        "Spyre static batching: warm-up shapes %s; max_model_len=%d, "
        "max_num_seqs=%d, max_num_batched_tokens=%d, block_size=%d",
        ", ".join(str(s) for s in spyre.warmup_shapes), max_model_len,
        scheduler_config.max_num_seqs,
        scheduler_config.max_num_batched_tokens, cache_config.block_size)


def configure_continuous_batching(vllm_config: "VllmConfig",
                                  spyre: SpyreConfig) -> None:
    """vLLM's own limits (``--max-model-len``, ``--max-num-seqs``), blocks
    of ``CB_BLOCK_SIZE`` tokens, one prefill per step."""
    scheduler_config = vllm_config.scheduler_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    _warn_ignored(spyre, "VLLM_SPYRE_USE_CB=1 compiles no warm-up shapes; "
                  "size continuous batching with --max-model-len and "
                  "--max-num-seqs instead.")
    if parallel_config.worker_cls == SPYRE_STATIC_WORKER_CLS:
        parallel_config.worker_cls = SPYRE_CB_WORKER_CLS
    max_model_len = scheduler_config.max_model_len
    from vllm.core.spyre_cb_scheduler import SpyreCBScheduler
    chunk = None
    if scheduler_config.chunked_prefill_enabled:
        chunk = prefill_chunk_size(scheduler_config.max_num_batched_tokens)
        # The chunk is the prefill's alone: a step's decode tokens (one a
        # running sequence) come on top of it.
        scheduler_config.max_num_batched_tokens = (
            chunk + scheduler_config.max_num_seqs)
        scheduler_config.max_num_partial_prefills = 1
        scheduler_config.scheduler_cls = functools.partial(
            SpyreCBScheduler, prefill_chunk=chunk)
    else:
        # A prefill step holds one whole sequence.
        scheduler_config.max_num_batched_tokens = max(
            scheduler_config.max_num_batched_tokens, max_model_len)
        _whole_prompts(scheduler_config, SpyreCBScheduler)
    cache_config.block_size = CB_BLOCK_SIZE
    logger.info(
        "Spyre continuous batching: max_model_len=%d, max_num_seqs=%d, "
        "block_size=%d, prefix caching %s, chunked prefill %s",
        max_model_len, scheduler_config.max_num_seqs,
        cache_config.block_size,
        "on" if cache_config.enable_prefix_caching else "off",
        f"on ({chunk}-token chunks)" if chunk else "off")


def configure_speculative(vllm_config: "VllmConfig", spyre: SpyreConfig,
                          hybrid: bool) -> None:
    """``--speculative-config``: n-gram proposals, a draft model's or an
    MLP speculator's, verified in one pass per step, under continuous
    batching on the CPU backends; anything else is refused here, naming
    what runs."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method = spec.method
    if method not in SPEC_METHODS:
        raise NotImplementedError(
            f"Speculative decoding method {method!r} is not supported on "
            f"Spyre; it runs {', '.join(SPEC_METHODS)} (n-gram prompt "
            "lookup: \"method\": \"ngram\"; a smaller model with the same "
            "tokenizer, or an MLP speculator: \"model\": <folder>)")
    if not spyre.use_cb:
        raise NotImplementedError(
            "Speculative decoding on Spyre runs under continuous batching: "
            "set VLLM_SPYRE_USE_CB=1 (a static batch decodes its sequences "
            "in lockstep, one token each)")
    if spyre.dynamo_backend == "sendnn":
        raise NotImplementedError(
            "Speculative decoding runs on the CPU backends "
            "(VLLM_SPYRE_DYNAMO_BACKEND=eager or inductor), not yet on the "
            "card (sendnn), whose verify graph has not been compiled")
    if hybrid:
        raise NotImplementedError(
            "Speculative decoding of a hybrid (Mamba-2 and attention) model "
            "is not supported on Spyre: a rejected proposal would have to "
            "be undone in its Mamba-2 states")
    k = spec.num_speculative_tokens
    scheduler_config = vllm_config.scheduler_config
    if k is None or not 1 <= k < CB_BLOCK_SIZE:
        raise ValueError(
            f"num_speculative_tokens={k}: Spyre verifies 1 to "
            f"{CB_BLOCK_SIZE - 1} proposed tokens a step (a sequence's "
            f"lookahead slots fit in one block of {CB_BLOCK_SIZE})")
    if k >= scheduler_config.max_model_len:
        raise ValueError(
            f"num_speculative_tokens={k} must be less than max_model_len="
            f"{scheduler_config.max_model_len}")
    if method == "ngram":
        low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
        if low is None or high is None or not 1 <= low <= high:
            raise ValueError(
                f"prompt_lookup_min={low} and prompt_lookup_max={high}: "
                "n-gram lookup needs 1 <= prompt_lookup_min <= "
                "prompt_lookup_max")
        how = (f"n-gram prompt lookup (suffixes of {low} to {high} "
               "tokens)")
    elif method == "mlp_speculator":
        _check_mlp_speculator(vllm_config)
        how = f"MLP speculator {spec.draft_model_config.model}"
    else:
        _check_draft_model(vllm_config)
        how = f"draft model {spec.draft_model_config.model}"
    parallel_config = vllm_config.parallel_config
    if parallel_config.worker_cls == SPYRE_CB_WORKER_CLS:
        parallel_config.worker_cls = SPYRE_SPEC_WORKER_CLS
    scheduler_config.num_lookahead_slots = k
    logger.info(
        "Spyre speculative decoding: %s, up to %d proposed tokens a "
        "sequence, verified in one pass of %d positions", how, k, k + 1)


def _check_mlp_speculator(vllm_config: "VllmConfig") -> None:
    """An MLP speculator reads the served model's hidden states and
    proposes in its vocabulary, a token per stage, in the driver rank's
    process (unsharded, also under tensor parallelism)."""
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config
    config = draft.hf_config
    target = vllm_config.model_config
    hidden = target.get_hidden_size()
    if config.emb_dim != hidden:
        raise ValueError(
            f"The MLP speculator {draft.model} reads hidden states of "
            f"{config.emb_dim} values (emb_dim), the served model's have "
            f"{hidden}: it was trained for another model")
    _same_vocabulary(draft, target)
    if spec.num_speculative_tokens > config.n_predict:
        raise ValueError(
            f"num_speculative_tokens={spec.num_speculative_tokens}: the MLP "
            f"speculator {draft.model} proposes at most {config.n_predict} "
            "tokens (n_predict), one per stage")


def _same_vocabulary(draft, target) -> None:
    theirs = draft.hf_text_config.vocab_size
    ours = target.hf_text_config.vocab_size
    if theirs != ours:
        raise ValueError(
            f"The draft model {draft.model} has a vocabulary of {theirs} "
            f"tokens, the served model {ours}: a draft model must share "
            "the served model's tokenizer")


def _check_draft_model(vllm_config: "VllmConfig") -> None:
    """A draft model proposes for the target's sequences over their
    block tables, whole in the driver worker's process: same vocabulary,
    as long a context."""
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config
    target = vllm_config.model_config
    _same_vocabulary(draft, target)
    max_model_len = vllm_config.scheduler_config.max_model_len
    if draft.max_model_len < max_model_len:
        raise ValueError(
            f"The draft model {draft.model} holds {draft.max_model_len} "
            f"positions, fewer than max_model_len={max_model_len}: lower "
            "--max-model-len")


def prefill_chunk_size(max_num_batched_tokens: int) -> int:
    """The prefill chunk of ``--enable-chunked-prefill``: vLLM's
    ``--max-num-batched-tokens``, which on Spyre must be whole blocks."""
    if (max_num_batched_tokens < CB_BLOCK_SIZE
            or max_num_batched_tokens % CB_BLOCK_SIZE):
        example = max(CB_BLOCK_SIZE, max_num_batched_tokens -
                      max_num_batched_tokens % CB_BLOCK_SIZE)
        raise ValueError(
            f"--max-num-batched-tokens {max_num_batched_tokens} is the "
            "prefill chunk under --enable-chunked-prefill, and on Spyre it "
            f"must be a multiple of the block size, {CB_BLOCK_SIZE} (for "
            f"example {example}).")
    return max_num_batched_tokens


def configure_images(vllm_config: "VllmConfig", spyre: SpyreConfig) -> None:
    """A vision-language model (images in, text out): static or
    continuous batching on the CPU backends, its vision tower run eagerly
    on every rank as a prefill starts (``spyre_image_inputs``; a static
    batch's prompt shapes hold the images' tokens), its heads split over the
    ranks as the language model's; what does not run yet is refused here,
    naming it."""
    model_config = vllm_config.model_config
    if not model_config.is_multimodal_model:
        return
    name = ", ".join(model_config.architectures)
    tp = vllm_config.parallel_config.tensor_parallel_size
    vision = getattr(model_config.hf_config, "vision_config", None)
    heads = getattr(vision, "num_attention_heads", 1)
    if heads % tp:
        raise ValueError(
            f"Tensor parallel size {tp} cannot split {name}'s vision "
            f"tower: its attention heads (num_attention_heads = {heads}) "
            "must be a multiple of the size")
    if model_config.quantization is not None:
        raise NotImplementedError(
            f"Quantized checkpoints of {name} ({model_config.quantization}) "
            "are not supported on Spyre")
    if vllm_config.speculative_config is not None:
        raise NotImplementedError(
            f"Speculative decoding of {name} is not supported on Spyre")
    if vllm_config.lora_config is not None:
        raise NotImplementedError(
            f"LoRA adapters on {name} are not supported on Spyre")
    logger.info(
        "Spyre images: %s's vision tower and projector run on vLLM's model "
        "code, eagerly, once per image as its prefill starts (on every "
        "rank); the language model prefills on the merged embeddings in "
        "its compiled graphs", name)


def configure_pooling(vllm_config: "VllmConfig",
                      spyre: SpyreConfig) -> None:
    """A pooling model (embeddings, cross-encoder scores): one forward pass
    per request over the warm-up shapes, several short texts packed into a
    row, no key/value cache."""
    model_config = vllm_config.model_config
    scheduler_config = vllm_config.scheduler_config
    parallel_config = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    _warn_ignored(spyre, "pooling models run one pass over the warm-up "
                  "shapes (VLLM_SPYRE_WARMUP_PROMPT_LENS x "
                  "VLLM_SPYRE_WARMUP_BATCH_SIZES) and generate nothing.")
    if spyre.require_precompiled:
        raise NotImplementedError(
            "VLLM_SPYRE_REQUIRE_PRECOMPILED=1 is not supported for pooling "
            "models on Spyre: the graph cache holds generators only.")
    if spyre.graph_cache_dir is not None:
        logger.warning("TORCH_SENDNN_CACHE_ENABLE=1 is ignored for pooling "
                       "models: their shapes compile at every start.")
    hf_max_len = _model_max_len(model_config.hf_text_config)
    if hf_max_len is not None:
        spyre.validate_model_len(hf_max_len)
    if parallel_config.worker_cls == SPYRE_STATIC_WORKER_CLS:
        parallel_config.worker_cls = SPYRE_POOLING_WORKER_CLS
    # The model's own limit, so that a text longer than every shape but
    # not than the model reaches SpyrePoolingScheduler, whose refusal names
    # the shapes; vLLM's length check answers texts beyond the model.
    max_model_len = max(spyre.max_model_len, hf_max_len or 0)
    model_config.max_model_len = max_model_len
    scheduler_config.max_model_len = max_model_len
    tokens = spyre.max_num_batched_tokens
    # Texts of a step: a shape's slots, at two tokens a text at least (a
    # tokenizer's start and end markers).
    scheduler_config.max_num_seqs = max(1, tokens // 2)
    scheduler_config.max_num_batched_tokens = tokens
    from vllm.core.spyre_pooling_scheduler import SpyrePoolingScheduler
    _whole_prompts(scheduler_config,
                   functools.partial(SpyrePoolingScheduler,
                                     spyre_config=spyre))
    cache_config.block_size = max_model_len
    cache_config.enable_prefix_caching = False
    logger.info(
        "Spyre pooling: warm-up shapes %s; max_model_len=%d, up to %d texts "
        "and %d tokens a step",
        ", ".join(f"{s.prompt_len}x{s.batch_size}"
                  for s in spyre.warmup_shapes), max_model_len,
        scheduler_config.max_num_seqs, tokens)


def _whole_prompts(scheduler_config, scheduler: Any) -> None:
    """Every prefill step holds whole prompts (no chunked prefill), and
    ``scheduler`` (the mode's class, or a partial binding the settings)
    schedules them."""
    scheduler_config.chunked_prefill_enabled = False
    scheduler_config.enable_chunked_prefill = False
    scheduler_config.scheduler_cls = scheduler


def _warn_ignored(spyre: SpyreConfig, why: str) -> None:
    """One warning per variable set in the environment that the mode
    ignores (``SpyreConfig.ignored_vars``), saying why."""
    for name in spyre.ignored_vars:
        logger.warning("%s is set but ignored: %s", name, why)


def configure_parallel(parallel_config, spyre: SpyreConfig) -> None:
    """Tensor parallel size from the flag or the deployment's environment,
    and the executor that runs that many cards."""
    if parallel_config.pipeline_parallel_size != 1:
        raise NotImplementedError(
            "Pipeline parallelism is not supported on Spyre")
    given = parallel_config.tensor_parallel_size
    tp = spyre.validate_tensor_parallel(given, tp_given=given != 1)
    if tp != given:
        logger.info("Spyre: tensor parallel size %d from the environment",
                    tp)
        parallel_config.tensor_parallel_size = tp
        parallel_config.world_size = tp
    backend = parallel_config.distributed_executor_backend
    if backend == "external_launcher":
        from vllm.executor.spyre_external_launcher_executor import (
            SpyreExternalLauncherExecutor)
        parallel_config.distributed_executor_backend = \
            SpyreExternalLauncherExecutor
    elif tp == 1:
        from vllm.executor.spyre_executor import SpyreExecutor
        parallel_config.distributed_executor_backend = SpyreExecutor
    elif backend == "ray":
        from vllm.executor.spyre_ray_executor import RaySpyreExecutor
        parallel_config.distributed_executor_backend = RaySpyreExecutor
    else:
        from vllm.executor.spyre_multiproc_executor import (
            MultiprocessingSpyreExecutor)
        parallel_config.distributed_executor_backend = \
            MultiprocessingSpyreExecutor


def _model_max_len(hf_config) -> Optional[int]:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
