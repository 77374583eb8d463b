"""SpyreEncoderModel: an FMS encoder (BERT, RoBERTa), compiled with
torch.compile, with vLLM's poolers on top: embeddings and cross-encoder
scores on Spyre.

The pooling model runner calls ``forward`` once per packed pass with the
tensors built by ``vllm.worker.spyre_pooling_inputs`` (``[B, L]`` token
ids, positions and token types, and a ``[B, L, L]`` block-diagonal mask):
the encoder body runs as one compiled graph per warm-up shape and returns
the hidden state of every slot.  The runner gathers the texts' hidden
states and hands them to ``pooler``, vLLM's own ``DispatchPooler``, which
applies the model's pooling type (from its sentence-transformers
configuration, else the architecture's default), normalisation,
``dimensions`` (Matryoshka) and, for cross-encoders, the classification
head and activation, exactly as vLLM's own BERT and RoBERTa models do.

The body is FMS's ``RoBERTaHeadless``, which FMS uses for BERT too; the
checkpoint is read through FMS's ``hf`` adapters (``bert``, ``roberta``
and their ``_classification`` variants), so FMS names, fuses and, under
tensor parallelism, shards the weights.  An architecture FMS lacks
(ModernBERT) runs on the Hugging Face body instead
(``spyre_hf_encoder``), with the same inputs and poolers.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.pooler import (ClassifierPooler, CLSPool,
                                               DispatchPooler, MeanPool,
                                               Pooler)
from vllm.model_executor.model_loader import (spyre_cpu_linear,
                                              spyre_graph_cache)
from vllm.model_executor.model_loader.spyre import serving_dtype
from vllm.model_executor.model_loader.spyre_hf_encoder import (
    HF_ENCODER_FAMILIES, HFEncoder, HFEncoderFamily)
from vllm.platforms.spyre_config import SpyreConfig

logger = init_logger(__name__)

#: FMS attention op of an encoder: SDPA with the given mask, not causal.
ATTN_NAME = "sdpa_bidirectional"
#: The same in bfloat16 (``--dtype bfloat16`` on the CPU backends).
ATTN_NAME_BF16 = "spyre_encoder_bf16"
#: The C++ kernel (``spyre_cpu::encoder_attention``) of the CPU ``inductor``
#: path, float32 and with bfloat16 products.
ATTN_NAME_CPU = "spyre_encoder_cpu"
ATTN_NAME_CPU_BF16 = "spyre_encoder_cpu_bf16"


def _store(keys: torch.Tensor, values: torch.Tensor, key_cache, value_cache,
           **attn_kwargs):
    """No cache: a pass attends over its own keys and values."""
    return keys, values, keys, values


def _compute_bf16(query: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, nheads: int, kvheads: int,
                  p_dropout: float, scale_factor, **attn_kwargs):
    """Bidirectional attention of ``[B, L, H, D]`` queries, keys and values
    under the ``[B, L, L]`` mask, its two products in bfloat16 (float32
    accumulation in PyTorch's CPU kernel); returns float32
    ``[B, L, H, D]`` as FMS expects."""
    bf16 = torch.bfloat16
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(2, 1).to(bf16) for t in (query, keys, values)),
        attn_mask=attn_kwargs["mask"].unsqueeze(1), scale=scale_factor)
    return out.transpose(2, 1).contiguous().to(query.dtype)


def _compute_kernel(query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, nheads: int, kvheads: int,
                    p_dropout: float, scale_factor, *, bf16_products: bool,
                    **attn_kwargs):
    """The C++ kernel: each text of a packed row attends to its own
    tokens only (``text_starts``), read straight from FMS's ``[B, L, H,
    D]`` projections, so the masked-out pairs cost nothing.  SDPA with the
    block-diagonal mask computes every pair of slots of a row, and in
    bfloat16 it runs no faster than in float32 here."""
    scale = query.shape[-1]**-0.5 if scale_factor is None else scale_factor
    return torch.ops.spyre_cpu.encoder_attention(
        query, keys, values, attn_kwargs["text_starts"], scale,
        bf16_products)


def register_attention() -> None:
    """Registers the encoder attention ops with FMS once per process."""
    from fms.modules import attention
    ops = {
        ATTN_NAME_BF16: _compute_bf16,
        ATTN_NAME_CPU: functools.partial(_compute_kernel,
                                         bf16_products=False),
        ATTN_NAME_CPU_BF16: functools.partial(_compute_kernel,
                                              bf16_products=True),
    }
    for name, compute in ops.items():
        try:
            attention.get_attention_type(attn_name=name)
        except KeyError:
            attention.register_attention_op(name, _store, compute)


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


def encoder_dtype(dtype: torch.dtype,
                  backend: str) -> tuple[torch.dtype, bool]:
    """The dtype an encoder's tensors are held in, and whether its matrix
    products run in bfloat16.  ``--dtype bfloat16`` on the CPU backends
    keeps the tensors float32 but runs every matrix product in bfloat16
    (``Bf16Linear``, ``ATTN_NAME_BF16``): embeddings then stay within
    cosine 0.9999 of float32 (docs/embeddings.md), which a model held
    wholly in bfloat16 does not."""
    if backend != "sendnn" and dtype == torch.bfloat16:
        return torch.float32, True
    return serving_dtype(dtype, backend), False


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
    it, else the Hugging Face body's (``spyre_hf_encoder``);
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


class _Encoder(nn.Module):
    """The FMS modules, named as FMS's adapters name the weights."""

    def __init__(self, config, strategy, classify: bool) -> None:
        super().__init__()
        from fms.models.roberta import RoBERTaHeadless
        from fms.modules.head import MLPClassificationHead
        from fms.utils.activation import str_to_activation
        #: The FMS attention op every layer runs.
        self.attn_name = ATTN_NAME
        self.config = config  # FMS's adapters read it
        self.base_model = RoBERTaHeadless(config, strategy)
        if classify:
            self.classification_head = MLPClassificationHead(
                config.emb_dim,
                num_classes=config.num_classes,
                activation_fn=str_to_activation(
                    config.classifier_activation_fn))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor, mask: torch.Tensor,
                text_starts: torch.Tensor) -> torch.Tensor:
        # SDPA reads the mask, the C++ kernel the texts' first slots.
        layout = ({"text_starts": text_starts} if self.attn_name
                  in (ATTN_NAME_CPU, ATTN_NAME_CPU_BF16) else {"mask": mask})
        return self.base_model(input_ids,
                               position_ids=position_ids,
                               token_type_ids=token_type_ids,
                               attn_name=self.attn_name,
                               **layout)


class SpyreEncoderModel(nn.Module):
    """FMS encoder compiled for the configured backend, with vLLM's
    poolers."""

    is_pooling_model = True

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__()
        self.spyre_config = spyre_config
        model_config = vllm_config.model_config
        #: The dtype of the encoder's tensors, and whether its matrix
        #: products run in bfloat16 (``encoder_dtype``).
        self.dtype, self.bf16_matmuls = encoder_dtype(
            model_config.dtype, spyre_config.dynamo_backend)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.hf_config = model_config.hf_config
        self.family = encoder_family(self.hf_config)
        check_parallel(self.family, self.tp_size)
        #: Position of each text's first token (``packed_inputs``).
        self.first_position = self.family.first_position(self.hf_config)
        if isinstance(self.family, HFEncoderFamily):
            self.encoder = self._load_hf(model_config.model)
        else:
            self.encoder = self._load(model_config.model)
            self._choose_attention(spyre_config.dynamo_backend)
        self.pooler = self._build_pooler(model_config)
        self.model = self._compile(self.encoder)

    def _choose_attention(self, backend: str) -> None:
        """FMS's attention op: SDPA (in bfloat16 under ``--dtype
        bfloat16``), or the C++ kernel on ``inductor``."""
        register_attention()
        if self.bf16_matmuls:
            n = spyre_cpu_linear.bf16_linears(self.encoder.base_model)
            self.encoder.attn_name = ATTN_NAME_BF16
            logger.info("Matrix products of %d linear layers and of "
                        "attention in bfloat16", n)
        if backend == "inductor" and spyre_cpu_linear.available():
            self.encoder.attn_name = (ATTN_NAME_CPU_BF16 if self.bf16_matmuls
                                      else ATTN_NAME_CPU)

    # ---- load -----------------------------------------------------------
    def _load_hf(self, path: str) -> HFEncoder:
        start = time.perf_counter()
        encoder = HFEncoder(path, self.family, self.dtype)
        if self.bf16_matmuls:
            n = spyre_cpu_linear.bf16_linears(encoder)
            logger.info("Matrix products of %d linear layers in bfloat16", n)
        logger.info("Loaded the Hugging Face %s encoder body from %s in "
                    "%.1f s (FMS has no such encoder)",
                    self.family.hf_architecture, path,
                    time.perf_counter() - start)
        return encoder

    def _load(self, path: str) -> _Encoder:
        from fms.models.roberta import (RoBERTaClassificationConfig,
                                        RoBERTaConfig)
        from fms.utils.serialization import load_state_dict_into_model
        start = time.perf_counter()
        params = self.family.params(self.hf_config)
        # Positions are always given (packed texts restart at 0), so FMS
        # must not derive them from a padding id, nor zero the embedding of
        # a token that happens to have that id.
        params.update(pos_emb="roberta", pad_id=None, p_dropout=0.0)
        config_cls = (RoBERTaClassificationConfig
                      if self.family.classify else RoBERTaConfig)
        config = config_cls(**params)
        encoder = _Encoder(config, self._strategy(), self.family.classify)
        encoder.to(self.dtype)
        with torch.no_grad():
            for tensor in _float_tensors(encoder):
                tensor.fill_(float("nan"))
        state_dict = self._checkpoint(path)
        load_state_dict_into_model(
            encoder, state_dict, architecture=self.family.fms_architecture,
            source="hf", dtype=self.dtype,
            distributed_strategy="tp" if self.tp_size > 1 else None)
        missing = [name for name, t in _named_float_tensors(encoder)
                   if torch.isnan(t).any()]
        if missing:
            raise ValueError(
                f"The checkpoint in {path} does not provide these weights "
                f"of the {self.family.hf_architecture} encoder: "
                f"{', '.join(missing)}")
        encoder.eval()
        encoder.requires_grad_(False)
        logger.info("Loaded FMS %s encoder from %s in %.1f s",
                    self.family.fms_architecture, path,
                    time.perf_counter() - start)
        return encoder

    def _strategy(self):
        from fms.distributed.strategy import (NoOpStrategy,
                                              TensorParallelStrategy)
        if self.tp_size == 1:
            return NoOpStrategy

        class LayersOnly(TensorParallelStrategy):
            """Shards the encoder blocks; the embeddings stay whole (gloo,
            the CPU process group, lacks the all-gather FMS's sharded
            embedding needs, and they are a small part of an encoder)."""

            def _distribute_module(self, module, final_layers=False):
                return module

        import torch.distributed as dist
        return LayersOnly(group=dist.group.WORLD)

    def _checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, named as FMS's adapter expects: the
        family's prefix added where a base model's checkpoint lacks it,
        and the pooler a base model never uses left out."""
        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        tensors: dict[str, torch.Tensor] = {}
        if files:
            from safetensors.torch import load_file
            for f in files:
                tensors.update(load_file(str(f)))
        else:
            for f in sorted(folder.glob("*.bin")):
                tensors.update(torch.load(f, map_location="cpu",
                                          weights_only=True))
        prefix = self.family.prefix
        named = {}
        for name, tensor in tensors.items():
            if name.startswith(("embeddings.", "encoder.", "pooler.")):
                name = prefix + name
            if name.endswith("position_ids"):
                continue  # a buffer some checkpoints carry, not a weight
            if not self.family.classify and name.startswith(prefix +
                                                            "pooler."):
                continue
            named[name] = tensor
        return named

    def _build_pooler(self, model_config) -> Pooler:
        """vLLM's poolers, by task, as vLLM's BERT and RoBERTa models build
        them."""
        pooler_config = model_config.pooler_config
        if not self.family.classify:
            return DispatchPooler({
                "encode": Pooler.for_encode(pooler_config),
                "embed": Pooler.for_embed(pooler_config),
            })
        if isinstance(self.encoder, HFEncoder):
            head = self.encoder.classify_head(self.dtype)
            pool = (MeanPool if self.encoder.classifier_pooling == "mean"
                    else CLSPool)
        else:
            head, pool = self.classify_head, CLSPool
        return DispatchPooler({
            "encode": Pooler.for_encode(pooler_config),
            "classify": ClassifierPooler(
                pooling=pool(), classifier=head,
                act_fn=ClassifierPooler.act_fn_for_seq_cls(model_config)),
            "score": ClassifierPooler(
                pooling=pool(), classifier=head,
                act_fn=ClassifierPooler.act_fn_for_cross_encoder(
                    model_config)),
        })

    def classify_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The cross-encoder's head on the first token's hidden state
        (BERT's pooler dense + tanh, RoBERTa's classifier dense + tanh,
        then the output projection): ``[N, H]`` -> ``[N, labels]``."""
        head = self.encoder.classification_head
        return head.head(head.act(head.dense(pooled.to(self.dtype))))

    # ---- compile --------------------------------------------------------
    def _compile(self, encoder: nn.Module) -> Callable:
        backend = self.spyre_config.dynamo_backend
        if backend == "sendnn":
            import torch_sendnn  # noqa: F401  registers the backend
        limit = max(64, 4 * len(self.spyre_config.warmup_shapes))
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
        options: dict = {}
        if backend != "sendnn":
            options["guard_filter_fn"] = \
                torch.compiler.skip_guard_on_all_nn_modules_unsafe
        if backend == "inductor":
            # Large matrix products (every token of the batch at once):
            # frozen weights let inductor pre-pack them for oneDNN.
            options.update(cpp_wrapper=True, freezing=True,
                           size_asserts=False, alignment_asserts=False)
            torch._dynamo.config.prepare_freezing = True
        # One graph per warm-up shape, as on the card.
        return spyre_graph_cache.DynamoGraphs(encoder, backend=backend,
                                              dynamic=False,
                                              options=options or None)

    @staticmethod
    def graph_name(batch_size: int, prompt_len: int) -> str:
        return f"encode-b{batch_size}-p{prompt_len}"

    def graph_cache_stats(self) -> dict[str, int]:
        """Pooling models compile at every start (no graph cache)."""
        return {}

    # ---- run ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor, mask: torch.Tensor,
                text_starts: torch.Tensor) -> torch.Tensor:
        """One packed pass: ``[B, L]`` inputs, ``[B, L, L]`` mask and
        ``[B, L]`` first slot of each slot's text -> the hidden state of
        every slot, ``[B * L, H]``."""
        B, L = input_ids.shape
        hidden = self.model(self.graph_name(B, L), input_ids, position_ids,
                            token_type_ids, mask, text_starts)
        return hidden.reshape(B * L, -1)


def _named_float_tensors(module: nn.Module):
    for name, t in list(module.named_parameters()) + list(
            module.named_buffers()):
        if t.is_floating_point():
            yield name, t


def _float_tensors(module: nn.Module):
    return [t for _, t in _named_float_tensors(module)]

