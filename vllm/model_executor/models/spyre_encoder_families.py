"""The encoder families Spyre runs for pooling models, and how each loads.

A pooling model's architecture picks its family: FMS's BERT or RoBERTa
encoder (``EncoderFamily``: which FMS adapter reads the checkpoint, the
weights' prefix, a classification head, how positions are numbered), or,
for an architecture FMS lacks, the Hugging Face encoder body
(``HFEncoderFamily``, ``spyre_hf_encoder``).  The platform calls
``encoder_family`` and ``check_parallel`` at start-up, so an unsupported
architecture or parallel layout is refused before anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderFamily:
    """How one Hugging Face encoder architecture maps onto FMS."""

    hf_architecture: str
    #: FMS architecture whose ``hf`` adapter reads the checkpoint.
    fms_architecture: str
    #: Prefix FMS's adapter expects before the encoder's weights; a base
    #: model's checkpoint (``BertModel``) stores them without it.
    prefix: str
    #: A cross-encoder: a classification head on the first token.
    classify: bool
    #: RoBERTa numbers positions after the padding id.
    roberta_positions: bool

    def params(self, hf_config) -> dict:
        """FMS model parameters from the Hugging Face config (FMS's own
        parameter builders)."""
        from fms.models.hf.config_utils import param_builders
        build = (param_builders.build_roberta_params if
                 self.roberta_positions else param_builders.build_bert_params)
        return build(hf_config, is_classify=self.classify)

    def first_position(self, hf_config) -> int:
        """The position embedding row (in FMS's table) of a text's first
        token: 0 for BERT; for RoBERTa the padding id + 1 in the Hugging
        Face table, whose first two rows FMS's adapter drops."""
        if not self.roberta_positions:
            return 0
        pad = hf_config.pad_token_id
        if pad is None or pad < 1:
            raise NotImplementedError(
                f"{self.hf_architecture} with pad_token_id={pad} is not "
                "supported on Spyre: FMS's RoBERTa adapter expects position "
                "ids numbered after a padding id of 1 or more.")
        return pad - 1


@dataclass(frozen=True)
class HFEncoderFamily:
    """How one Hugging Face encoder architecture runs on its own body."""

    hf_architecture: str
    #: A cross-encoder: a classification head on the pooled text.
    classify: bool

    def first_position(self, hf_config) -> int:
        """Positions count from 0 (rotary embeddings)."""
        return 0


HF_ENCODER_FAMILIES = {
    f.hf_architecture: f
    for f in (HFEncoderFamily("ModernBertForSequenceClassification",
                              classify=True), )
}


def _families() -> dict[str, EncoderFamily]:
    rows = [
        ("BertModel", "bert", "bert.", False, False),
        ("BertForSequenceClassification", "bert_classification", "bert.",
         True, False),
        ("RobertaModel", "roberta", "roberta.", False, True),
        ("XLMRobertaModel", "roberta", "roberta.", False, True),
        ("RobertaForSequenceClassification", "roberta_classification",
         "roberta.", True, True),
        ("XLMRobertaForSequenceClassification", "roberta_classification",
         "roberta.", True, True),
    ]
    return {r[0]: EncoderFamily(*r) for r in rows}


ENCODER_FAMILIES = _families()


def encoder_family(hf_config) -> EncoderFamily | HFEncoderFamily:
    """The family of a pooling model's architecture: FMS's where FMS has
    it, else the Hugging Face body's (``HFEncoderFamily``);
    NotImplementedError naming the supported ones otherwise."""
    for arch in getattr(hf_config, "architectures", None) or ():
        if arch in ENCODER_FAMILIES:
            return ENCODER_FAMILIES[arch]
        if arch in HF_ENCODER_FAMILIES:
            return HF_ENCODER_FAMILIES[arch]
    listed = ", ".join([*ENCODER_FAMILIES, *HF_ENCODER_FAMILIES])
    raise NotImplementedError(
        f"Pooling models of architecture {hf_config.architectures} are not "
        f"supported on Spyre; supported encoders: {listed}.")


def check_parallel(family: EncoderFamily | HFEncoderFamily,
                   tp_size: int) -> None:
    """NotImplementedError for tensor parallelism on a Hugging Face body,
    which is not sharded."""
    if isinstance(family, HFEncoderFamily) and tp_size > 1:
        raise NotImplementedError(
            f"--tensor-parallel-size {tp_size} is not supported for "
            f"{family.hf_architecture} on Spyre: it runs on the Hugging "
            "Face encoder body, which is not sharded (FMS's BERT and "
            "RoBERTa encoders are); use --tensor-parallel-size 1.")
