"""Tiny random encoder checkpoints for the pooling tests: BERT and RoBERTa
embedders and cross-encoders, and a ModernBERT cross-encoder, built at
test-session start.

Each has 6 heads of 16 (splits over 3 ranks), 2 layers and the suite's
offline-trained BPE tokenizer, made to frame a text as BERT's and
RoBERTa's tokenizers do (``<s> text </s>``, a BERT pair as
``<s> a </s> b </s>`` with token types 0 then 1, a RoBERTa pair as
``<s> a </s></s> b </s>``).  ``pooling`` writes a
sentence-transformers configuration, as real embedders ship, so that vLLM
reads the pooling type and normalisation from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from spyre_support.tiny_models import build_tokenizer

if TYPE_CHECKING:
    import torch

#: Special tokens in RoBERTa's order: its padding id is 1.
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BERT_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")

ARCHITECTURES = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "bert-cross": "BertForSequenceClassification",
    "roberta-cross": "RobertaForSequenceClassification",
    "modernbert-cross": "ModernBertForSequenceClassification",
}


def _tokenizer(roberta: bool, seed: int):
    """BERT's framing (a pair's second text has token type 1), or
    RoBERTa's (``<s> a </s></s> b </s>``, no token types)."""
    from tokenizers.processors import TemplateProcessing
    tok = build_tokenizer(seed,
                          ROBERTA_SPECIALS if roberta else BERT_SPECIALS)
    bos, eos = tok.convert_tokens_to_ids(["<s>", "</s>"])
    pair = ("<s> $A </s> </s> $B </s>"
            if roberta else "<s> $A </s> $B:1 </s>:1")
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A </s>", pair=pair,
        special_tokens=[("<s>", bos), ("</s>", eos)])
    tok.model_input_names = (["input_ids", "attention_mask"] if roberta else
                             ["input_ids", "token_type_ids",
                              "attention_mask"])
    return tok


def build_tiny_encoder(kind: str, out_dir: Path, seed: int = 0,
                       pooling: Optional[str] = None,
                       matryoshka: bool = False) -> Path:
    """A tiny random ``kind`` (a key of ``ARCHITECTURES``) checkpoint.
    ``pooling`` ("mean" or "cls") writes a sentence-transformers config
    with that pooling and normalisation; ``matryoshka`` marks the model as
    trained for truncated embeddings (``dimensions``)."""
    import torch
    import transformers
    modern = kind.startswith("modernbert")
    # ModernBERT takes no token types: RoBERTa's framing.
    roberta = kind.startswith("roberta") or modern
    tokenizer = _tokenizer(roberta, seed)
    pad = tokenizer.pad_token_id
    common = dict(vocab_size=len(tokenizer), hidden_size=96,
                  intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=6, pad_token_id=pad,
                  initializer_range=0.2, num_labels=1,
                  torch_dtype="float32")
    if modern:
        # Three layers: one global, two local with a 16-token window, so
        # texts longer than the window tell the two apart.
        bos, eos = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])
        config = transformers.ModernBertConfig(
            **common | dict(num_hidden_layers=3), max_position_embeddings=512,
            local_attention=16, global_attn_every_n_layers=3,
            bos_token_id=bos, eos_token_id=eos, cls_token_id=bos,
            sep_token_id=eos, classifier_pooling="mean",
            reference_compile=False)
    else:
        config_cls = (transformers.RobertaConfig
                      if roberta else transformers.BertConfig)
        config = config_cls(**common, max_position_embeddings=514,
                            type_vocab_size=1 if roberta else 2)
    model_cls = getattr(transformers, ARCHITECTURES[kind])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if matryoshka:
        model.config.is_matryoshka = True
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if pooling is not None:
        _sentence_transformers_config(out_dir, pooling, model.config)
    return out_dir


def _sentence_transformers_config(out_dir: Path, pooling: str,
                                  config) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "",
         "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }, indent=2))
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 512, "do_lower_case": False}))


# ---- references ------------------------------------------------------------

def hf_embeddings(model_dir: Path, texts: list[list[int]], pooling: str,
                  dimensions: Optional[int] = None) -> torch.Tensor:
    """The reference embeddings: transformers' encoder on each text alone,
    then the model's pooling (``"mean"`` or ``"cls"``), Matryoshka
    truncation to ``dimensions`` and L2 normalisation."""
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in texts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vec = hidden.mean(0) if pooling == "mean" else hidden[0]
            if dimensions is not None:
                vec = vec[:dimensions]
            out.append(torch.nn.functional.normalize(vec, dim=0))
    return torch.stack(out)


def hf_scores(model_dir: Path, query: str, documents: list[str]) -> list:
    """The reference cross-encoder scores: transformers' sequence
    classifier on each (query, document) pair, through a sigmoid (one
    label), as sentence-transformers' CrossEncoder scores them."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits
                          [0, 0]).item() for d in documents
        ]


def random_texts(count: int, longest: int, vocab: tuple[int, int],
                 frame: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """``count`` token-id texts of 1 to ``longest`` tokens (ids drawn from
    ``vocab``, a half-open range), each framed by ``frame`` (start, end
    marker ids) when it has room, lengths spread evenly and shuffled."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(1, longest, count).round().long()
    lengths = lengths[torch.randperm(count, generator=gen)].tolist()
    texts = []
    for n in lengths:
        ids = torch.randint(*vocab, (n, ), generator=gen).tolist()
        if n >= 2:
            ids[0], ids[-1] = frame
        texts.append(ids)
    return texts
