"""A Hugging Face ``config.json`` read the way transformers reads it,
before FMS maps it to its own model config.

transformers lets some optional config fields be null and gives null a
meaning in its model code (GPT-BigCode's ``n_inner``: 4 x ``n_embd``; a
null ``attention_bias``: no bias).  FMS 1.13.1's mapping
(``fms.models.hf.config_utils``) passes the null on, and then fails with a
raw ``TypeError`` (``n_inner`` inside the mapping; ``attention_dropout``
and ``max_position_embeddings`` when the model is built) or happens to
read it right.  ``fms_config_params`` gives each such field transformers'
meaning first, then runs FMS's own mapping:

* ``NULL_MEANINGS``: config fields set before mapping, for every family
  whose config has them;
* ``FMS_DEFAULT_WHEN_NULL``: FMS parameters a null field leaves None that
  transformers does not use to run the model (``max_position_embeddings``
  only bounds a rotary cache, which FMS grows on demand): FMS's own
  default applies;
* FMS sizes an MLP as ``int(hidden_grow_factor * hidden)`` from the ratio
  the mapping computes, which floating point can round one unit short
  (960 / 704 gives 959): the ratio is nudged so that it gives the
  config's width exactly.

Fields that transformers itself cannot run with when null (``rope_theta``,
``rms_norm_eps``, Granite's multipliers, ...) are not valid checkpoints
and are not guessed.
"""
from __future__ import annotations

from typing import Any, Callable

from vllm.logger import init_logger

logger = init_logger(__name__)

#: Config field -> its value when null, as transformers' model code reads
#: it (``config -> value``).
NULL_MEANINGS: dict[str, Callable[[Any], Any]] = {
    # GPT-BigCode's MLP width: 4 x n_embd.
    "n_inner": lambda c: 4 * c.n_embd,
    # Falsy in transformers: one key/value head per query head, no biases,
    # an output head of its own, no dropout.
    "multi_query": lambda c: False,
    "attention_bias": lambda c: False,
    "mlp_bias": lambda c: False,
    "tie_word_embeddings": lambda c: False,
    "attention_dropout": lambda c: 0.0,
}

#: FMS parameters that take FMS's default when the mapping leaves None.
FMS_DEFAULT_WHEN_NULL = ("max_expected_seq_len", )

#: Config fields holding the MLP width, by family.
_MLP_WIDTH_FIELDS = ("intermediate_size", "n_inner")


def with_null_meanings(hf_config) -> tuple[Any, list[str]]:
    """A copy of ``hf_config`` whose null fields of ``NULL_MEANINGS`` hold
    transformers' meaning, and the names of those fields."""
    import copy
    config = copy.deepcopy(hf_config)
    filled = []
    for name, meaning in NULL_MEANINGS.items():
        if name in config.to_dict() and getattr(config, name) is None:
            setattr(config, name, meaning(config))
            filled.append(name)
    return config, filled


def fms_config_params(model_path: str) -> dict:
    """FMS's ``get_model`` parameters for the folder's ``config.json``
    (what ``fms.models.hf.utils.infer_model_configuration`` returns), with
    null fields read as transformers reads them."""
    from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY
    from transformers import AutoConfig
    config, filled = with_null_meanings(AutoConfig.from_pretrained(model_path))
    if filled:
        logger.info("Null config fields read as transformers reads them: %s",
                    ", ".join(f"{n}={getattr(config, n)!r}" for n in filled))
    # FMS's own entry point loads the config itself; this is the mapping
    # it then runs, on the config read above.
    params = _FMS_MODEL_CONFIG_REGISTRY.hf_config_to_fms_config_params(
        config, model_path=None)
    for name in FMS_DEFAULT_WHEN_NULL:
        if name in params and params[name] is None:
            del params[name]
    _exact_mlp_width(params, config)
    return params


def _exact_mlp_width(params: dict, config) -> None:
    """``hidden_grow_factor`` such that FMS's ``int(factor * hidden)`` is
    the config's MLP width."""
    if "hidden_grow_factor" not in params:
        return
    hidden = getattr(config, "hidden_size", None)
    width = next((getattr(config, f) for f in _MLP_WIDTH_FIELDS
                  if getattr(config, f, None) is not None), None)
    if not hidden or not width:
        return
    if int(params["hidden_grow_factor"] * hidden) != width:
        params["hidden_grow_factor"] = (width + 0.5) / hidden
