"""Tiny random Hugging Face checkpoints, built at test-session start.

One offline-trained BPE tokenizer (vocabulary 384) is shared by every
checkpoint.  ``build_tiny_llama`` is the suite's workhorse;
``build_tiny_family`` makes a checkpoint of each other FMS decoder family
with the feature that family adds (``FAMILIES``), 6 query heads so that
tensor parallelism over 3 ranks splits them.
"""
from __future__ import annotations

from pathlib import Path

#: Token ids of the shared tokenizer's special tokens.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

#: A sliding window longer than the 64 + 16 tokens of the tests' shapes,
#: shorter than a 64 + 64 shape.
WINDOW = 80


def build_tokenizer(seed: int = 0,
                    specials=("<pad>", "<s>", "</s>", "<unk>")):
    """A byte-level BPE tokenizer trained on a small generated corpus;
    ``specials`` take the first ids, in order."""
    import torch
    from tokenizers import (Tokenizer, decoders, models, pre_tokenizers,
                            trainers)
    from transformers import PreTrainedTokenizerFast

    words = ("spyre card batch token shape prompt model cache graph compile "
             "serve request decode prefill tensor kernel the a of to in and "
             "is on with for fast slow red green blue one two three").split()
    rng = torch.Generator().manual_seed(seed)
    corpus = [
        " ".join(words[int(i)] for i in torch.randint(
            0, len(words), (12, ), generator=rng)) for _ in range(400)
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.model_max_length = 512
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
    return fast


def _save(model, tokenizer, out_dir: Path) -> Path:
    model.generation_config.eos_token_id = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _common(vocab: int, heads: int, positions: int = 1024) -> dict:
    """Settings every tiny checkpoint shares: head size 16, 2 layers,
    1024 positions unless told otherwise, and random weights large enough
    that greedy choices are far from ties."""
    return dict(vocab_size=vocab, hidden_size=16 * heads,
                intermediate_size=32 * heads, num_hidden_layers=2,
                num_attention_heads=heads,
                max_position_embeddings=positions,
                initializer_range=0.3, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                tie_word_embeddings=False, torch_dtype="float32")


def build_tiny_llama(out_dir: Path, seed: int = 0, heads: int = 4,
                     kv_heads: int = 2, tied: bool = False,
                     positions: int = 1024) -> Path:
    """A 2-layer Llama (head size 16, GQA 4/2 heads and 1024 positions
    unless told otherwise); ``tied``: its output head is its token
    embedding, as in SmolLM2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    config = LlamaConfig(**{
        **_common(len(tokenizer), heads, positions),
        "tie_word_embeddings": tied
    }, num_key_value_heads=kv_heads, rms_norm_eps=1e-5)
    return _save(LlamaForCausalLM(config).eval(), tokenizer, out_dir)


def build_bf16_valued_llama(out_dir: Path, dtype, hidden: int = 64,
                            layers: int = 2, intermediate: int = 128,
                            tied: bool = False) -> Path:
    """A random Llama whose values are all bfloat16 numbers, saved in
    ``dtype``: its bfloat16 and float32 copies hold the same values, so a
    model read from either must be the same."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**{
        **_common(len(tokenizer), hidden // 16),
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "tie_word_embeddings": tied,
        "torch_dtype": str(dtype).removeprefix("torch.")
    }, num_key_value_heads=hidden // 32, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).to(torch.bfloat16).to(dtype).eval()
    return _save(model, tokenizer, out_dir)


def _llama(vocab: int, heads: int = 6, kv_heads: int = 3,
           intermediate=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    common = _common(vocab, heads)
    if intermediate is not None:
        common["intermediate_size"] = intermediate
    return LlamaForCausalLM(LlamaConfig(**common,
                                        num_key_value_heads=kv_heads,
                                        rms_norm_eps=1e-5))


def _granite(vocab: int):
    from transformers import GraniteConfig, GraniteForCausalLM
    # Every multiplier away from 1, so that a family that ignored one of
    # them would not match.
    return GraniteForCausalLM(GraniteConfig(
        **_common(vocab, 6), num_key_value_heads=3, rms_norm_eps=1e-5,
        embedding_multiplier=2.0, attention_multiplier=0.15,
        residual_multiplier=0.7, logits_scaling=0.5))


def _gpt_bigcode(vocab: int, n_inner=192):
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    # Multi-query attention (one key/value head), learned positions;
    # ``n_inner=None``: the MLP 4 x n_embd wide, the config's field null.
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(
        vocab_size=vocab, n_embd=96, n_inner=n_inner, n_layer=2, n_head=6,
        n_positions=1024, multi_query=True, initializer_range=0.3,
        activation_function="gelu_pytorch_tanh", bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="float32"))


def _mistral(vocab: int, window: int = WINDOW):
    from transformers import MistralConfig, MistralForCausalLM
    # A sliding window the family tests' sequences stay inside;
    # test_sliding_window builds one they outgrow.
    return MistralForCausalLM(MistralConfig(
        **_common(vocab, 6), num_key_value_heads=3, head_dim=16,
        rms_norm_eps=1e-5, sliding_window=window))


def _mixtral(vocab: int):
    from transformers import MixtralConfig, MixtralForCausalLM
    # Top-2 of 4 experts.
    return MixtralForCausalLM(MixtralConfig(
        **_common(vocab, 6), num_key_value_heads=3, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None))


def _qwen3(vocab: int, window: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # q/k normalisation is always on in Qwen3.
    return Qwen3ForCausalLM(Qwen3Config(
        **_common(vocab, 6), num_key_value_heads=3, head_dim=16,
        rms_norm_eps=1e-6, use_sliding_window=window, sliding_window=WINDOW,
        max_window_layers=0))


def _qwen2(vocab: int, tied: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    # Biases on the q/k/v projections; no sliding window; ``tied``: the
    # output head is the token embedding (vLLM's Qwen2 then uses the
    # embedding module as its head).
    return Qwen2ForCausalLM(Qwen2Config(
        **{**_common(vocab, 6), "tie_word_embeddings": tied},
        num_key_value_heads=3, rms_norm_eps=1e-6, use_sliding_window=False))


def _phi3(vocab: int):
    from transformers import Phi3Config, Phi3ForCausalLM
    # Fused qkv and gate/up projections, partial rotary embedding.
    return Phi3ForCausalLM(Phi3Config(
        **_common(vocab, 6), num_key_value_heads=3, rms_norm_eps=1e-5,
        partial_rotary_factor=0.5, sliding_window=None,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def _bamba(vocab: int, groups: int = 2, proj_bias: bool = True):
    """Hybrid: Mamba-2 layers 0 and 2 around an attention layer; the scan
    in chunks of 16 positions, so that prompts span several; the
    parameters transformers initialises to constants (norms, D, the time
    step bias, the decay rates) drawn at random, so a layer that ignored
    one would not match."""
    from transformers import BambaConfig, BambaForCausalLM
    model = BambaForCausalLM(BambaConfig(
        **{**_common(vocab, 6), "num_hidden_layers": 3},
        num_key_value_heads=3, rms_norm_eps=1e-5,
        attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_head=24, mamba_expand=2, mamba_d_state=16,
        mamba_n_groups=groups, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_proj_bias=proj_bias, mamba_conv_bias=True))
    return _random_mamba_constants(model)


def _random_mamba_constants(model):
    """Draws at random the parameters transformers initialises to
    constants (norms, D, the time step bias, the decay rates)."""
    import torch
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".D", "dt_bias", "bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4
                                  + 0.5))
    return model


#: Family name -> model factory taking the vocabulary size.
FAMILIES = {
    "granite": _granite,
    "gpt_bigcode": _gpt_bigcode,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen3": _qwen3,
}

def _granite4(vocab: int, layer_types=None, experts: int = 0,
              positions: str = "rope", layers: int = 2, tied: bool = False):
    """Granite 4 (``GraniteMoeHybridForCausalLM``), by default in its
    dense form: every layer attention, no experts, rotary positions, a
    shared MLP whose width (``shared_intermediate_size``) is not
    ``intermediate_size``, and every multiplier away from 1;
    ``layer_types``, ``experts`` and ``positions="nope"`` give its other
    forms; ``tied``: the output head is the token embedding, as in IBM's
    checkpoints."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    common = {**_common(vocab, 6), "num_hidden_layers": layers,
              "tie_word_embeddings": tied}
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **common, num_key_value_heads=3, rms_norm_eps=1e-5,
        shared_intermediate_size=168, num_local_experts=experts,
        num_experts_per_tok=2 if experts else 0,
        position_embedding_type=positions,
        layer_types=layer_types or ["attention"] * layers,
        mamba_n_heads=8, mamba_d_head=24, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_proj_bias=True,
        embedding_multiplier=2.0, attention_multiplier=0.15,
        residual_multiplier=0.7, logits_scaling=0.5))


def _granite4_h(vocab: int):
    """Granite 4's hybrid form as the ``-h`` models have it: Mamba-2 layers
    0 and 2 around an attention layer without position embeddings
    ("nope"), top-2 of 4 experts beside the shared MLP, and the output
    head tied to the token embedding."""
    return _random_mamba_constants(_granite4(
        vocab, layer_types=["mamba", "attention", "mamba"], experts=4,
        positions="nope", layers=3, tied=True))


FAMILIES["granite4"] = _granite4

#: GPT-OSS's window on its sliding layers, far shorter than the sequences
#: the tests serve.
GPT_OSS_WINDOW = 12


def _gpt_oss(vocab: int):
    """GPT-OSS (``GptOssForCausalLM``): a sliding layer (window
    ``GPT_OSS_WINDOW``) then a full one, attention sinks, top-2 of 4
    experts with biases and the clamped SwiGLU, YaRN as the released
    models have it (factor 32, here over 32 original positions).
    transformers starts every bias at zero; here the biases and sinks are
    random and as large as the other weights (the sinks larger), so a
    model that dropped any of them would answer otherwise."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM
    common = {**_common(vocab, 6), "intermediate_size": 64}
    model = GptOssForCausalLM(GptOssConfig(
        **common, num_key_value_heads=3, head_dim=16, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2,
        sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 32}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.rand(param.shape) * 6 - 1)
            elif name.endswith("bias"):
                param.normal_(std=0.3)
    return model


FAMILIES["gpt_oss"] = _gpt_oss

#: Hybrid (Mamba-2 and attention) families.
HYBRID = {
    "bamba": _bamba,
    "granite4_h": _granite4_h,
}


def build_retrained(src_dir: Path, out_dir: Path, seed: int = 1) -> Path:
    """The checkpoint of ``src_dir`` after a "training step": the same
    architecture and tokenizer, every weight moved by random noise as large
    as the weights themselves, so that greedy outputs change."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src_dir,
                                                 dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return _save(model.eval(), AutoTokenizer.from_pretrained(src_dir),
                 out_dir)


#: Architectures FMS lacks, served by vLLM's model code on Spyre.
VLLM_ONLY = {
    "qwen2": _qwen2,
    "phi3": _phi3,
}


def build_tiny_family(family: str, out_dir: Path, seed: int = 0,
                      **options) -> Path:
    """A tiny random checkpoint of ``family`` (a key of ``FAMILIES`` or
    ``VLLM_ONLY``, or ``"llama"``);
    ``options`` go to its factory (``window=True`` for Qwen3, a window
    length for Mistral)."""
    import torch
    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    factories = {**FAMILIES, **VLLM_ONLY, **HYBRID, "llama": _llama}
    model = factories[family](len(tokenizer), **options).eval()
    return _save(model, tokenizer, out_dir)


def build_tiny_fms(max_len: int):
    """A random 2-layer FMS LLaMA (hidden 64, GQA 4/2 heads, vocabulary
    96), for tests of the attention ops without an engine."""
    import torch
    from fms.models.llama import LLaMA, LLaMAConfig
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=96, emb_dim=64, nheads=4,
                              kvheads=2, nlayers=2, hidden_grow_factor=2.0,
                              max_expected_seq_len=max_len))
    model.reset_parameters()
    model.post_init()
    return model.eval()


def build_tiny_draft(out_dir: Path, like: Path, seed: int = 1) -> Path:
    """A 2-layer random Llama with the vocabulary and tokenizer of the
    checkpoint at ``like``: a speculative draft model for it."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM
    target = AutoConfig.from_pretrained(like)
    tokenizer = AutoTokenizer.from_pretrained(like)
    torch.manual_seed(seed)
    common = _common(target.vocab_size, 4)
    common.update(bos_token_id=target.bos_token_id,
                  eos_token_id=target.eos_token_id,
                  pad_token_id=getattr(target, "pad_token_id", None),
                  max_position_embeddings=target.max_position_embeddings)
    config = LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5)
    return _save(LlamaForCausalLM(config).eval(), tokenizer, out_dir)


def build_tiny_mlp_speculator(out_dir: Path, like: Path, n_predict: int = 4,
                              inner_dim: int = 32, seed: int = 2,
                              scale_input: bool = True) -> Path:
    """A random MLP speculator (IBM's ``MLPSpeculator``, as vLLM loads it)
    for the checkpoint at ``like``: its hidden size and vocabulary,
    ``n_predict`` stages."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig
    target = AutoConfig.from_pretrained(like)
    vocab, emb = target.vocab_size, target.hidden_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1]**0.5)

    tensors = {}
    for i in range(n_predict):
        tensors[f"emb.{i}.weight"] = rand(vocab, inner_dim) * inner_dim**0.5
        tensors[f"proj.{i}.weight"] = rand(inner_dim,
                                           emb if i == 0 else inner_dim)
        tensors[f"head.{i}.weight"] = rand(vocab, inner_dim) * 4
        tensors[f"ln.{i}.weight"] = torch.ones(inner_dim)
        tensors[f"ln.{i}.bias"] = torch.zeros(inner_dim)
    if scale_input:
        tensors["ln0.weight"] = torch.ones(emb)
        tensors["ln0.bias"] = torch.zeros(emb)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator", "vocab_size": vocab,
        "emb_dim": emb, "inner_dim": inner_dim, "n_predict": n_predict,
        "top_k_tokens_per_head": [1] * n_predict, "n_candidates": 1,
        "tie_weights": False, "scale_input": scale_input,
        "torch_dtype": "float32"}))
    return out_dir
