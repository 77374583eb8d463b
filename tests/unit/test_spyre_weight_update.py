"""The pure parts of in-place weight updates (``spyre_weight_update``):
what a checkpoint's layout requires, the checks that refuse a state dict
before anything is copied, the layer grouping of the copy, and the setting
that keeps inductor's weights graph inputs.  Engines
updated end to end: ``tests/e2e/test_weight_update.py``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.spyre_kernels import ops as native
from vllm.model_executor.layers import spyre_linear
from vllm.model_executor.model_loader.spyre_weight_update import (
    CheckpointLayout, _layer_of, check_state_dict, load_in_place)

LAYOUT = CheckpointLayout(
    shapes={"model.embed_tokens.weight": (10, 4),
            "model.layers.0.mlp.up_proj.weight": (8, 4),
            "model.norm.weight": (4, )},
    optional={"lm_head.weight": (10, 4)})


def state_dict(**changes):
    sd = {name: torch.zeros(shape) for name, shape in LAYOUT.shapes.items()}
    sd.update(changes)
    return {k: v for k, v in sd.items() if v is not None}


def test_layout_from_safetensors_headers(tmp_path):
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4),
               "model.norm.weight": torch.zeros(4)},
              str(tmp_path / "model.safetensors"))
    tied = CheckpointLayout.read(str(tmp_path),
                                 SimpleNamespace(tie_word_embeddings=True))
    assert tied.shapes == {"model.embed_tokens.weight": (10, 4),
                           "model.norm.weight": (4, )}
    assert tied.optional == {"lm_head.weight": (10, 4)}
    untied = CheckpointLayout.read(str(tmp_path),
                                   SimpleNamespace(tie_word_embeddings=False))
    assert untied.optional == {}


def test_layout_needs_safetensors(tmp_path):
    with pytest.raises(NotImplementedError, match="safetensors checkpoint"):
        CheckpointLayout.read(str(tmp_path), SimpleNamespace())


def test_a_matching_state_dict_passes_with_or_without_the_tied_head():
    check_state_dict(state_dict(), LAYOUT)
    check_state_dict(state_dict(**{"lm_head.weight": torch.ones(10, 4)}),
                     LAYOUT)
    # Another floating dtype is cast when copied.
    check_state_dict(
        state_dict(**{"model.norm.weight": torch.ones(
            4, dtype=torch.bfloat16)}), LAYOUT)


@pytest.mark.parametrize("sd, named", [
    (state_dict(**{"model.norm.weight": None}),
     "missing model.norm.weight"),
    (state_dict(**{"model.layers.5.x": torch.ones(1)}),
     "not in the model: model.layers.5.x"),
    (state_dict(**{"lm_head.weight": torch.ones(9, 4)}),
     "lm_head.weight has shape (9, 4), the model's is (10, 4)"),
    (state_dict(**{"model.norm.weight": torch.ones(4, dtype=torch.int32)}),
     "model.norm.weight is a torch.int32 tensor, not a floating-point"),
    (state_dict(**{"model.norm.weight": torch.empty(4, device="meta")}),
     "model.norm.weight is a meta tensor (no data)"),
    (state_dict(**{"model.norm.weight": [1.0] * 4}),
     "model.norm.weight is list, not a floating-point tensor"),
])
def test_each_mismatch_is_named(sd, named):
    with pytest.raises(ValueError, match="the model keeps its weights") as e:
        check_state_dict(sd, LAYOUT)
    assert named in str(e.value)


def test_many_missing_names_are_summarised():
    layout = CheckpointLayout({f"w{i}": (1, ) for i in range(9)}, {})
    with pytest.raises(ValueError, match=r"missing w0, w1, w2, w3, w4 and 4 "
                       "more"):
        check_state_dict({}, layout)


def test_not_a_mapping_is_refused():
    with pytest.raises(ValueError, match="not list"):
        check_state_dict([], LAYOUT)


@pytest.mark.parametrize("name, layer", [
    ("model.layers.11.self_attn.q_proj.weight", 11),
    ("base_model.layers.3.attn.in_proj.qkv_fused", 3),
    ("transformer.h.0.attn.c_attn.weight", 0),
    ("model.embed_tokens.weight", None),
    ("head", None),
])
def test_layer_of(name, layer):
    assert _layer_of(name) == layer


@pytest.mark.skipif(not native.available(),
                    reason="no C++ compiler for the kernel")
def test_packed_fms_model_takes_new_weights_in_place():
    """A tiny FMS LLaMA, packed, updated with another one's state dict: its
    logits become the other model's, its buffers stay the same objects and
    no staging weight is left behind."""
    from fms.models.llama import LLaMA, LLaMAConfig

    def llama(seed):
        torch.manual_seed(seed)
        model = LLaMA(LLaMAConfig(src_vocab_size=100, emb_dim=64, nheads=4,
                                  kvheads=2, nlayers=2, tie_heads=True,
                                  hidden_grow_factor=2.0,
                                  max_expected_seq_len=64))
        model.reset_parameters()
        model.post_init()
        return model.eval().requires_grad_(False)

    served, new = llama(0), llama(1)
    spyre_linear.pack_linears(served)
    buffers = dict(served.named_buffers())
    # In FMS's own naming (no adapter), the tied head under both names.
    sd = new.state_dict()
    layout = CheckpointLayout({n: tuple(t.shape) for n, t in sd.items()}, {})
    check_state_dict(sd, layout)
    assert load_in_place(served, sd, layout, architecture="llama",
                         source=None, tensor_parallel=False) == len(sd)
    assert all(b is buffers[n] for n, b in served.named_buffers())
    assert not [m for m in served.modules() if hasattr(m, "weight")
                and isinstance(m, spyre_linear.PackedLinear)]
    ids = torch.randint(0, 100, (2, 9),
                        generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(served(ids), new(ids), rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("value, freezing", [(None, True), ("1", True),
                                             ("0", False)])
def test_freezing_setting(value, freezing):
    from vllm.config.spyre import SpyreConfig
    env = {"VLLM_SPYRE_DYNAMO_BACKEND": "inductor"}
    if value is not None:
        env["VLLM_SPYRE_INDUCTOR_FREEZING"] = value
    cfg = SpyreConfig.from_env(environ=env)
    assert cfg.inductor_freezing is freezing
    # Workers get the setting through the vLLM config.
    assert SpyreConfig.from_dict(cfg.to_dict()) == cfg


def test_a_bad_freezing_value_is_refused():
    from vllm.config.spyre import SpyreConfig
    with pytest.raises(ValueError,
                       match="VLLM_SPYRE_INDUCTOR_FREEZING='yes' is invalid"):
        SpyreConfig.from_env(environ={"VLLM_SPYRE_INDUCTOR_FREEZING": "yes"})
