"""Draft models in ``--speculative-config`` on Spyre.

vLLM 0.10.1.1's ``SpeculativeConfig`` recognises a draft model (a folder
whose model type is no speculator head: ``"method": "draft_model"``) and
then refuses it, since no upstream V0 worker runs one any more.  Spyre's
speculative runner does (``spyre_draft``), so ``install`` (a
``vllm.general_plugins`` entry point) lets the config through on Spyre:
where upstream raises for a draft model, the wrapper sets the fields
upstream would set after it (the draft's tensor-parallel size, its
``max_model_len``, its parallel config), through upstream's own helpers.
On any other platform, and for every other error, upstream's error stands.

IBM's MLP speculators name the architecture
``MLPSpeculatorPreTrainedModel``, which vLLM 0.10.1.1's model registry
lists only in a comment (its V1 engine does not run them): ``install``
registers vLLM's own ``MLPSpeculator`` class under that name on Spyre, so
that vLLM's config accepts such a folder as the speculative model.
"""
from __future__ import annotations

from vllm.engine.spyre_upstream_wraps import wrap_once


#: IBM's MLP speculators' architecture, and vLLM's class of it.
MLP_SPECULATOR = ("MLPSpeculatorPreTrainedModel",
                  "vllm.model_executor.models.mlp_speculator:MLPSpeculator")


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.config import SpeculativeConfig
    wrap_once(SpeculativeConfig, "__post_init__", _accepting_draft_models)
    from vllm.config.spyre import is_spyre
    if not is_spyre():
        return
    from vllm import ModelRegistry
    if MLP_SPECULATOR[0] not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(*MLP_SPECULATOR)


def _accepting_draft_models(original):

    def __post_init__(spec) -> None:
        try:
            original(spec)
        except NotImplementedError:
            from vllm.config.spyre import is_spyre
            if spec.method != "draft_model" or not is_spyre():
                raise
            _finish_draft_model(spec)

    return __post_init__


def _finish_draft_model(spec) -> None:
    """What upstream sets after detecting a draft model."""
    from vllm.config import SpeculativeConfig
    spec.draft_tensor_parallel_size = (
        SpeculativeConfig._verify_and_get_draft_tp(
            spec.target_parallel_config, spec.draft_tensor_parallel_size,
            spec.draft_model_config.hf_config))
    spec.draft_model_config.max_model_len = (
        SpeculativeConfig._maybe_override_draft_max_model_len(
            spec.max_model_len, spec.draft_model_config.max_model_len,
            spec.target_model_config.max_model_len))
    spec.draft_parallel_config = (
        SpeculativeConfig.create_draft_parallel_config(
            spec.target_parallel_config, spec.draft_tensor_parallel_size))
