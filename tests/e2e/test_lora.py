"""LoRA adapters on Spyre (``--enable-lora``, docs/lora.md).

Four tiny random adapters of the tiny Llama, written with PEFT (ranks 8
and 4, over every projection, a few, or the token embedding and the
output head), are the subjects; the reference
of each is transformers running it merged into the base model
(``merge_and_unload``).

* Rows of one batch on different adapters and on none, more adapters than
  ``--max-loras`` among the requests: every request's greedy ids equal
  its merged reference, in static and continuous batching, ``eager`` and
  ``inductor``, and nothing compiles after warm-up.
* Prompt log-probabilities of a row on an adapter, static and continuous
  batching.
* Continuous batching with forced preemption, and with prefix caching
  (one prompt on every adapter: no adapter reads another's cached
  blocks, and a repeat is served from the cache).
* Adapters added, evicted (``--max-cpu-loras``) and removed while
  serving, nothing compiled; tensor parallel over 2 ranks (static and
  continuous batching); ``inductor``'s
  graphs with adapters loaded from the graph cache at the next start; the
  memory check's count of the slots against what the layers hold;
  bfloat16 rows without an adapter equal to the engine without LoRA, and
  rows on one equal to transformers' bfloat16 merged where stable.
* Refusals: an adapter above ``--max-lora-rank``, one trained for another
  base model, one carrying the base model's embedding and head, one of a
  module the model lacks, a missing folder and a corrupt file are refused
  when their request arrives, naming the problem, and the engine keeps
  serving; FMS's model code is refused at start-up.
* Granite, Mistral, Qwen2, Qwen3 and Phi-3 checkpoints run their adapters
  too.
"""
from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from spyre_support.engines import compile_count, mode_env, spyre_llm
from spyre_support.reference import assert_prompt_logprobs_equal
from spyre_support.tiny_lora import (ALL_PROJECTIONS, MergedReference,
                                     build_adapter)
from spyre_support.tiny_models import build_tiny_family

#: Engine arguments every test shares: vLLM's model code, 2 adapter slots
#: of rank up to 16 (the kernel's vector path; rank 8 takes the other).
LORA_ARGS = dict(model_impl="vllm", enable_lora=True, max_loras=2,
                 max_lora_rank=16)
#: (prompt ids, new tokens, adapter name or None): four adapters (one of
#: them on the token embedding and the output head), more than the two
#: slots, with rows on none between them.
REQUESTS = [(list(range(5, 5 + n)), m, a) for n, m, a in (
    (9, 12, "all"), (40, 8, None), (2, 10, "some"), (17, 12, "all"),
    (30, 6, "third"), (12, 9, None), (21, 7, "heads"))]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tiny_llama_3kv, tmp_path_factory) -> dict:
    """name -> adapter folder."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {
        "all": build_adapter(tiny_llama, root / "all", seed=1, rank=8),
        "some": build_adapter(tiny_llama, root / "some", seed=2, rank=4,
                              targets=("q_proj", "v_proj", "down_proj")),
        "third": build_adapter(tiny_llama, root / "third", seed=3, rank=8,
                               targets=("o_proj", "up_proj")),
        "heads": build_adapter(tiny_llama, root / "heads", seed=7, rank=8,
                               targets=("q_proj", "embed_tokens",
                                        "lm_head")),
        # PEFT's default for an adapted embedding: the base model's
        # embedding and head saved too, which vLLM does not load.
        "with_bases": build_adapter(tiny_llama, root / "with_bases", seed=8,
                                    rank=8, targets=("q_proj", "lm_head"),
                                    with_embedding_layers=True),
        "rank32": build_adapter(tiny_llama, root / "rank32", seed=4,
                                rank=32),
        # 6 heads of 16: every projection takes 96 inputs, not 64.
        "alien": build_adapter(tiny_llama_3kv, root / "alien", seed=5,
                               rank=8),
    }
    # An adapter of a module the model lacks: "all" with one projection
    # renamed.
    stranger = root / "stranger"
    shutil.copytree(folders["all"], stranger)
    weights = load_file(stranger / "adapter_model.safetensors")
    save_file({k.replace("layers.0.mlp.up_proj", "layers.0.mlp.side_proj"): v
               for k, v in weights.items()},
              stranger / "adapter_model.safetensors")
    folders["stranger"] = stranger
    corrupt = build_adapter(tiny_llama, root / "corrupt", seed=6, rank=8)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    folders["corrupt"] = corrupt
    return folders


@pytest.fixture(scope="module")
def want(tiny_llama, adapters):
    """want(prompt, new tokens, adapter name or None): the merged
    reference's greedy ids."""
    refs: dict = {}

    def greedy(prompt, max_tokens, name):
        if name not in refs:
            refs[name] = MergedReference(tiny_llama,
                                         adapters[name] if name else None)
        return refs[name].greedy(prompt, max_tokens)[0]

    return greedy


def lora(adapters, name):
    """The ``LoRARequest`` of an adapter (ids in a fixed order)."""
    from vllm.lora.request import LoRARequest
    if name is None:
        return None
    ids = {n: i for i, n in enumerate(sorted(adapters), 1)}
    return LoRARequest(name, ids[name], str(adapters[name]))


def generate(llm, adapters, requests) -> list[list[int]]:
    """Greedy ids of ``(prompt, new tokens, adapter)`` requests, sent
    together."""
    from vllm import SamplingParams, TokensPrompt
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _, _ in requests],
        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
         for _, m, _ in requests],
        lora_request=[lora(adapters, a) for _, _, a in requests],
        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def lora_llm(model, mode: str, backend: str, **kwargs):
    env, kwargs = mode_env(mode, backend, [64], [12], [4], 128,
                           dict(LORA_ARGS, **kwargs))
    return spyre_llm(model, env, **kwargs)


def test_the_adapters_change_the_answers(want):
    """The subjects are not vacuous: each adapter's reference differs from
    the base model's on every request."""
    for prompt, m, _ in REQUESTS:
        base = want(prompt, m, None)
        for name in ("all", "some", "third", "heads"):
            assert want(prompt, m, name) != base


@pytest.mark.parametrize("mode,backend", [("static", "eager"),
                                          ("static", "inductor"),
                                          ("cb", "eager"),
                                          ("cb", "inductor")])
def test_each_row_runs_its_own_adapter(tiny_llama, adapters, want, mode,
                                       backend):
    with lora_llm(tiny_llama, mode, backend) as llm:
        before = compile_count()
        got = generate(llm, adapters, REQUESTS)
        assert compile_count() == before
    assert got == [want(p, m, a) for p, m, a in REQUESTS]


def test_preempted_adapter_rows_finish_with_their_tokens(
        tiny_llama, adapters, want):
    """Four 60-token prompts growing past one 64-token block each, 7
    blocks for the 8 they need: the scheduler preempts and recomputes,
    each on its adapter."""
    requests = [(list(range(10 + i, 70 + i)), 30, a)
                for i, a in enumerate(("all", None, "some", "all"))]
    with lora_llm(tiny_llama, "cb", "eager",
                  num_gpu_blocks_override=7) as llm:
        got = generate(llm, adapters, requests)
        preemptions = llm.llm_engine.scheduler[0].num_cumulative_preemption
    assert preemptions > 0
    assert got == [want(p, m, a) for p, m, a in requests]


def test_prefix_cache_is_kept_per_adapter(tiny_llama, adapters, want):
    """One 100-token prompt (a whole 64-token block to cache) on the base
    model, then each adapter, then again: each answer is its adapter's
    (no adapter ran on another's cached keys and values), and the repeats
    hit the cache."""
    from vllm.utils import Device
    prompt = list(range(3, 103))
    order = [None, "all", "some", "all", None, "some"]
    with lora_llm(tiny_llama, "cb", "eager",
                  enable_prefix_caching=True) as llm:
        got = [generate(llm, adapters, [(prompt, 6, a)])[0] for a in order]
        hit_rate = llm.llm_engine.scheduler[0].block_manager.\
            get_prefix_cache_hit_rate(Device.GPU)
    assert got == [want(prompt, 6, a) for a in order]
    assert hit_rate > 0


def test_adapters_come_and_go_while_serving(tiny_llama, adapters, want):
    """One slot (of rank 8: the kernel's path for ranks that are not a
    multiple of 16), two adapters kept in memory: each new adapter evicts
    the oldest, a removed one is loaded again at its next request, and
    nothing compiles."""
    one = [(list(range(7, 27)), 8, None)]
    with lora_llm(tiny_llama, "cb", "eager", max_loras=1,
                  max_cpu_loras=2, max_lora_rank=8) as llm:
        engine = llm.llm_engine
        before = compile_count()
        seen = []
        for name in ("all", "some", "third", "all"):
            (prompt, m, _), = one
            assert generate(llm, adapters, [(prompt, m, name)]) == \
                [want(prompt, m, name)]
            seen.append(sorted(engine.list_loras()))
        ids = {n: lora(adapters, n).lora_int_id for n in adapters}
        assert seen[-1] == sorted([ids["third"], ids["all"]])
        assert engine.remove_lora(ids["all"])
        assert ids["all"] not in engine.list_loras()
        assert engine.add_lora(lora(adapters, "some"))
        assert generate(llm, adapters, [(one[0][0], 8, "all")]) == \
            [want(one[0][0], 8, "all")]
        assert compile_count() == before


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_prompt_logprobs_run_on_the_adapter(tiny_llama, adapters, mode):
    """``prompt_logprobs`` of a row on an adapter, in a batch with a row
    on none: the log-softmax of transformers' logits with the adapter
    merged, at every position after the first."""
    from vllm import SamplingParams, TokensPrompt
    prompts = [list(range(4, 34)), list(range(40, 60))]
    with lora_llm(tiny_llama, mode, "eager") as llm:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
            lora_request=[lora(adapters, "all"), None], use_tqdm=False)
    for prompt, out, name in zip(prompts, outs, ("all", None)):
        model = MergedReference(tiny_llama,
                                adapters[name] if name else None).model
        assert_prompt_logprobs_equal(out, model, prompt)


def lora_memory(worker) -> dict:
    """What a rank's LoRA layers hold (for ``collective_rpc``): the bytes
    of their stacked adapter tensors, and the memory check's count of the
    same slots (``spyre_lora_memory.lora_slot_elements``)."""
    import torch

    from vllm.worker import spyre_lora_memory as memory
    lora = worker.model_runner.model.lora
    held, seen = 0, set()
    for module in lora.manager._adapter_manager.modules.values():
        for name in ("lora_a_stacked", "lora_b_stacked",
                     "embeddings_tensors"):
            value = getattr(module, name, None)
            for t in value if isinstance(value, tuple) else (value, ):
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    held += t.numel() * t.element_size()
    _, geometry = worker._memory_parts()
    config = worker.lora_config
    counted = config.max_loras * memory.lora_item(config, geometry) * \
        memory.lora_slot_elements(geometry, config.max_lora_rank,
                                  config.lora_extra_vocab_size)
    return dict(held=held, counted=counted)


def test_the_memory_check_counts_the_adapter_slots(tiny_llama, adapters):
    with lora_llm(tiny_llama, "cb", "eager") as llm:
        (memory, ) = llm.collective_rpc(lora_memory)
    assert memory["held"] > 0
    assert abs(memory["counted"] / memory["held"] - 1) < 0.1, memory


def test_bad_adapters_are_refused_and_the_engine_serves_on(
        tiny_llama, adapters, want, tmp_path):
    from vllm.lora.request import LoRARequest
    prompt = list(range(5, 20))
    good = [(prompt, 8, "all"), (prompt, 8, None)]
    missing = LoRARequest("missing", 50, str(tmp_path / "nowhere"))
    with lora_llm(tiny_llama, "cb", "eager") as llm:
        refusals = {}
        for name in ("rank32", "alien", "corrupt", "with_bases", "stranger"):
            with pytest.raises(ValueError) as e:
                generate(llm, adapters, good + [(prompt, 8, name)])
            refusals[name] = str(e.value)
        from vllm import SamplingParams
        with pytest.raises(ValueError) as e:
            llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(max_tokens=4), lora_request=missing)
        refusals["missing"] = str(e.value)
        # Nothing of the refused calls was queued, and the engine serves.
        assert not llm.llm_engine.has_unfinished_requests()
        assert generate(llm, adapters, good) == \
            [want(p, m, a) for p, m, a in good]
    assert "LoRA rank 32 is greater than max_lora_rank 16" in \
        refusals["rank32"]
    assert "does not fit this base model" in refusals["alien"]
    assert "was it trained for another model?" in refusals["alien"]
    assert "'corrupt' cannot be served" in refusals["corrupt"]
    assert "No adapter found at" in refusals["missing"]
    assert "lm_head.base_layer.weight is unsupported LoRA weight" in \
        refusals["with_bases"]
    assert "side_proj" in refusals["stranger"]


def test_fms_model_code_is_refused_at_start_up(tiny_llama):
    args = dict(LORA_ARGS, model_impl="auto")
    with pytest.raises(NotImplementedError, match="--model-impl vllm"):
        with lora_llm(tiny_llama, "cb", "eager", **args):
            pass


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_tensor_parallel_2_equals_merged_transformers(
        tiny_llama, adapters, want, mode):
    """Two ranks over gloo, each holding its shard of every adapter
    (vLLM's sharded LoRA layers)."""
    with lora_llm(tiny_llama, mode, "eager",
                  tensor_parallel_size=2) as llm:
        got = generate(llm, adapters, REQUESTS)
    assert got == [want(p, m, a) for p, m, a in REQUESTS]


def test_graphs_with_adapters_come_from_the_graph_cache(
        tiny_llama, adapters, want, tmp_path):
    """``inductor`` with the graph cache on: the second start loads every
    graph the first compiled (the adapters' tensors are graph inputs), and
    both serve every row on its adapter."""
    env, kwargs = mode_env("cb", "inductor", [64], [12], [4], 128,
                           dict(LORA_ARGS))
    env = dict(env, TORCH_SENDNN_CACHE_ENABLE="1",
               TORCH_SENDNN_CACHE_DIR=str(tmp_path / "graphs"))
    stats = []
    for _ in range(2):
        with spyre_llm(tiny_llama, env, **kwargs) as llm:
            (cache, ) = llm.collective_rpc("get_graph_cache_stats")
            stats.append(cache)
            assert generate(llm, adapters, REQUESTS) == \
                [want(p, m, a) for p, m, a in REQUESTS]
    assert stats[0].get("compiled", 0) > 0
    assert stats[1].get("loaded", 0) == stats[0]["compiled"]
    assert stats[1].get("compiled", 0) == 0


def test_bfloat16_adapters(tiny_llama, adapters):
    """``--dtype bfloat16`` (the adapters in bfloat16 too): the rows on no
    adapter give exactly the ids of the same engine without LoRA (their
    layers add nothing); the rows on an adapter give other ids, equal to
    transformers' bfloat16 with the adapter merged wherever its top token
    is stable (``bf16_quality.TeacherForced``: the lead of its top logit
    over the next above twice its bfloat16 error), as test_bf16.py judges
    the base model."""
    from bf16_quality import TeacherForced
    requests = [(list(range(5 + i, 5 + i + n)), 24, a) for i, (n, a) in
                enumerate([(9, "all"), (40, None), (2, "some"), (17, "all"),
                           (30, "some"), (12, None), (21, "all")])]
    with lora_llm(tiny_llama, "cb", "eager", dtype="bfloat16") as llm:
        got = generate(llm, adapters, requests)
    env, kwargs = mode_env("cb", "eager", [64], [12], [4], 128,
                           dict(model_impl="vllm", dtype="bfloat16"))
    with spyre_llm(tiny_llama, env, **kwargs) as llm:
        plain = generate(llm, adapters,
                         [(p, m, None) for p, m, _ in requests])
    for (_, _, name), ids, base in zip(requests, got, plain):
        assert (ids == base) == (name is None)
    judges = {name: TeacherForced(str(tiny_llama), str(adapters[name]))
              for name in ("all", "some")}
    judged = [judges[name].judge(prompt, ids)
              for (prompt, _, name), ids in zip(requests, got) if name]
    stable = sum(sum(j.stable) for j in judged)
    assert stable >= 40, f"only {stable} stable positions"
    assert not [j.stable_mismatches() for j in judged
                if j.stable_mismatches()]


#: The adapted modules of each family: Phi-3 fuses its attention
#: projections and its gate and up projections in its checkpoint.
FAMILY_TARGETS = dict(phi3=("qkv_proj", "o_proj", "gate_up_proj",
                            "down_proj"))


@pytest.mark.parametrize("family",
                         ["granite", "mistral", "qwen2", "qwen3", "phi3"])
def test_other_architectures_run_their_adapters(family, tmp_path):
    """The other architectures ``--enable-lora`` runs on vLLM's model code
    (tiny random checkpoints, an adapter over every projection): greedy
    ids equal transformers' with the adapter merged."""
    base = build_tiny_family(family, tmp_path / family)
    adapter = build_adapter(base, tmp_path / "adapter", seed=9, rank=8,
                            targets=FAMILY_TARGETS.get(family,
                                                       ALL_PROJECTIONS))
    requests = [(list(range(5, 25)), 8, "it"), (list(range(30, 42)), 8,
                                                None)]
    with lora_llm(base, "cb", "eager") as llm:
        got = generate(llm, {"it": adapter}, requests)
    refs = {"it": MergedReference(base, adapter),
            None: MergedReference(base, None)}
    assert got == [refs[a].greedy(p, m)[0] for p, m, a in requests]
