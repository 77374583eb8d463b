"""New weights loaded in place (``update_weights_in_place`` through
``LLM.collective_rpc``): after the update the engine's greedy ids equal
transformers' on the new checkpoint, with nothing compiled, on ``eager``
and ``inductor`` (whose packed layers, a tied head among them, are
repacked), static and continuous batching; a state dict that does not
match is refused naming the tensor and the old weights keep serving;
graphs with frozen weights and mixture-of-experts models refuse clearly;
TP=3 through the multiprocessing executor.  Tensor parallel over three
torchrun ranks: ``test_external_launcher.py``."""
from __future__ import annotations

import pytest
import torch

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_tiny_family, build_tiny_llama
from spyre_support.tiny_models import build_retrained

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
MAX_TOKENS = 8
#: inductor keeps the weights graph inputs only when told (they are frozen
#: into its graphs by default).
UNFROZEN = {"VLLM_SPYRE_INDUCTOR_FREEZING": "0"}
STATIC = {"eager": spyre_env("eager", [64], [MAX_TOKENS], [2]),
          "inductor": {**spyre_env("inductor", [64], [MAX_TOKENS], [2]),
                       **UNFROZEN}}
CB = cb_env("eager")


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                       ignore_eos=True),
        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


class Checkpoints:
    """Checkpoint A (loaded), B (pushed), their transformers ids, and B's
    state dict as transformers holds it."""

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.ids_a = self.reference(a)
        hf_b = HFReference(b)
        self.ids_b = [hf_b.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]
        self.state_dict_b = hf_b.model.state_dict()
        assert self.ids_b != self.ids_a

    @staticmethod
    def reference(path) -> list[list[int]]:
        hf = HFReference(path)
        return [hf.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def untied(tiny_llama, tmp_path_factory) -> Checkpoints:
    return Checkpoints(
        tiny_llama,
        build_retrained(tiny_llama, tmp_path_factory.mktemp("retrained")))


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Checkpoints:
    a = build_tiny_llama(tmp_path_factory.mktemp("tied"), tied=True)
    return Checkpoints(
        a, build_retrained(a, tmp_path_factory.mktemp("tied-retrained")))


@pytest.mark.parametrize("backend, head, mode", [
    ("eager", "untied", "static"),
    ("inductor", "untied", "static"),
    ("inductor", "tied", "static"),
    ("eager", "untied", "cb"),
])
def test_update_gives_transformers_ids_of_the_new_weights(
        request, backend, head, mode):
    ckpt: Checkpoints = request.getfixturevalue(head)
    env, args = STATIC[backend], {}
    if mode == "cb":
        env, args = CB, {"max_model_len": 256, "max_num_seqs": 2}
    with spyre_llm(ckpt.a, env, **args) as llm:
        assert greedy(llm) == ckpt.ids_a
        before = compile_count()
        (done, ) = llm.collective_rpc("update_weights_in_place",
                                      args=(ckpt.state_dict_b, ))
        assert greedy(llm) == ckpt.ids_b
        assert compile_count() - before == 0
        # A tied head arrives as lm_head.weight too, and is not loaded
        # twice: it follows the embedding.
        assert done["tensors"] == len(ckpt.state_dict_b) - (head == "tied")


def test_a_mismatching_state_dict_is_refused_and_the_old_weights_serve(
        untied):
    good = untied.state_dict_b
    wrong_shape = {**good, "model.norm.weight": torch.ones(3)}
    missing = {k: v for k, v in good.items() if k != "lm_head.weight"}
    extra = {**good, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}
    not_float = {**good, "model.norm.weight": torch.ones(64,
                                                         dtype=torch.int64)}
    with spyre_llm(untied.a, STATIC["eager"]) as llm:
        for bad, named in [
            (wrong_shape, "model.norm.weight has shape (3,), the model's "
             "is (64,)"),
            (missing, "missing lm_head.weight"),
            (extra, "not in the model: model.layers.9.mlp.up_proj.weight"),
            (not_float, "model.norm.weight is a torch.int64 tensor"),
        ]:
            with pytest.raises(ValueError, match="Refused the weight update") \
                    as refused:
                llm.collective_rpc("update_weights_in_place", args=(bad, ))
            assert named in str(refused.value)
            assert greedy(llm) == untied.ids_a
        llm.collective_rpc("update_weights_in_place", args=(good, ))
        assert greedy(llm) == untied.ids_b


def test_graphs_with_frozen_weights_refuse_updates(untied):
    """inductor's default freezes the weights into its graphs: an update
    would be silently ignored, so it is refused, naming the setting."""
    env = spyre_env("inductor", [64], [MAX_TOKENS], [2])
    with spyre_llm(untied.a, env) as llm:
        with pytest.raises(NotImplementedError,
                           match="VLLM_SPYRE_INDUCTOR_FREEZING=0"):
            llm.collective_rpc("update_weights_in_place",
                               args=(untied.state_dict_b, ))
        assert greedy(llm) == untied.ids_a


def test_mixture_of_experts_refuses_updates(tmp_path):
    model = build_tiny_family("mixtral", tmp_path / "mixtral")
    hf = HFReference(model)
    with spyre_llm(model, STATIC["eager"]) as llm:
        with pytest.raises(NotImplementedError,
                           match="MixtralForCausalLM models are not "
                           "supported"):
            llm.collective_rpc("update_weights_in_place",
                               args=(hf.model.state_dict(), ))


def test_update_reaches_every_multiprocessing_rank(tiny_llama_3kv,
                                                   tmp_path):
    """TP=3 through the multiprocessing executor: the state dict is sent
    to each worker process, every rank keeps its shard, and a refusal on
    the ranks leaves them all serving the old weights."""
    ckpt = Checkpoints(tiny_llama_3kv,
                       build_retrained(tiny_llama_3kv, tmp_path / "b"))
    bad = {k: v for k, v in ckpt.state_dict_b.items()
           if k != "model.norm.weight"}
    with spyre_llm(ckpt.a, STATIC["eager"], tensor_parallel_size=3) as llm:
        with pytest.raises(ValueError, match="missing model.norm.weight"):
            llm.collective_rpc("update_weights_in_place", args=(bad, ))
        assert greedy(llm) == ckpt.ids_a
        done = llm.collective_rpc("update_weights_in_place",
                                  args=(ckpt.state_dict_b, ))
        assert [d["tensors"] for d in done] == [len(ckpt.state_dict_b)] * 3
        assert greedy(llm) == ckpt.ids_b
