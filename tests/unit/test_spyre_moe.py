"""The dense mixture-of-experts layer (``spyre_moe``) against transformers'
Mixtral block and FMS's own sparse forward on the same weights, and its
one compiled graph for every token count."""
import pytest
import torch

from vllm.model_executor.layers import spyre_moe

DIM, INNER, EXPERTS, TOP_K = 16, 24, 4, 2


@pytest.fixture(scope="module")
def layers():
    """(transformers' MixtralSparseMoeBlock, FMS's MOEFeedForward) holding
    the same random weights."""
    from fms.modules.feedforward import MOEFeedForward
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralSparseMoeBlock)
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=DIM, intermediate_size=INNER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K)).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    fms = MOEFeedForward(EXPERTS, TOP_K, DIM, INNER).eval()
    with torch.no_grad():
        fms.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(hf.experts):
            fms.cond_ffn.w13[e].copy_(
                torch.cat([expert.w1.weight, expert.w3.weight]))
            fms.cond_ffn.w2[e].copy_(expert.w2.weight)
    return hf, fms


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n, DIM, generator=torch.Generator().manual_seed(seed))


def dense_copy(fms_layer):
    import copy
    layer = copy.deepcopy(fms_layer)
    assert spyre_moe.use_dense_experts(torch.nn.Sequential(layer)) == 1
    return layer


@torch.no_grad()
def test_dense_equals_transformers_and_fms_sparse(layers):
    hf, fms = layers
    dense = dense_copy(fms)
    x = tokens(37)
    expected = hf(x)[0]
    torch.testing.assert_close(fms(x), expected, rtol=1e-5, atol=1e-5)
    got = dense(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_router_weights_keep_the_top_k_renormalised():
    scores = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    weights = spyre_moe.router_weights(scores, 2)
    assert (weights > 0).sum(dim=-1).tolist() == [2, 2]
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))
    share = 1 / (1 + torch.tensor(-1.0).exp().item())  # e^2 / (e^2 + e^1)
    assert weights[0].tolist() == pytest.approx([0.0, share, 1 - share, 0.0])
    assert weights[1].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])


@torch.no_grad()
def test_one_graph_for_every_token_count(layers):
    """No shape depends on the routing: one dynamic graph, no graph break,
    serves 2, 7 and 12 tokens.  (FMS's sparse layer picks its kernel's
    padding by ``numel() <= num_experts``, which at 2 tokens pins the
    dynamic dimension to a constant: ``ConstraintViolationError``.)"""
    hf, fms = layers
    dense = dense_copy(fms)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(dense, backend="eager", fullgraph=True)
    for n in (2, 7, 12):
        x = tokens(n, seed=n)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(compiled(x), hf(x)[0], rtol=1e-5,
                                   atol=1e-5)
    assert counts["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("variant", [dict(use_bias=True),
                                     dict(topk_first=True)])
def test_other_variants_are_refused(variant):
    from fms.modules.feedforward import MOEFeedForward
    layer = MOEFeedForward(EXPERTS, TOP_K, DIM, INNER, **variant)
    with pytest.raises(ValueError, match="0: mixture-of-experts layers"):
        spyre_moe.use_dense_experts(torch.nn.Sequential(layer))
