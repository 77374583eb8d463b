"""LoRA adapters on Spyre (``--enable-lora``, docs/lora.md).

Three tiny random adapters of the tiny Llama, written with PEFT (ranks 8
and 4, over every projection or a few), are the subjects; the reference
of each is transformers running it merged into the base model
(``merge_and_unload``).

* Rows of one batch on different adapters and on none, more adapters than
  ``--max-loras`` among the requests: every request's greedy ids equal
  its merged reference, in static and continuous batching, ``eager`` and
  ``inductor``, and nothing compiles after warm-up.
* Continuous batching with forced preemption, and with prefix caching
  (one prompt on every adapter: no adapter reads another's cached
  blocks, and a repeat is served from the cache).
* Adapters added, evicted (``--max-cpu-loras``) and removed while
  serving, nothing compiled.
* Refusals: an adapter above ``--max-lora-rank``, one trained for another
  base model, a missing folder and a corrupt file are refused when their
  request arrives, naming the problem, and the engine keeps serving;
  FMS's model code is refused at start-up.
"""
from __future__ import annotations

import pytest

from spyre_support.engines import compile_count, mode_env, spyre_llm
from spyre_support.tiny_lora import MergedReference, build_adapter

#: Engine arguments every test shares: vLLM's model code, 2 adapter slots
#: of rank up to 8.
LORA_ARGS = dict(model_impl="vllm", enable_lora=True, max_loras=2,
                 max_lora_rank=8)
#: (prompt ids, new tokens, adapter name or None): three adapters, more
#: than the two slots, with rows on none between them.
REQUESTS = [(list(range(5, 5 + n)), m, a) for n, m, a in (
    (9, 12, "all"), (40, 8, None), (2, 10, "some"), (17, 12, "all"),
    (30, 6, "third"), (12, 9, None))]


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
        "rank16": build_adapter(tiny_llama, root / "rank16", seed=4,
                                rank=16),
        # 6 heads of 16: every projection takes 96 inputs, not 64.
        "alien": build_adapter(tiny_llama_3kv, root / "alien", seed=5,
                               rank=8),
    }
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
        for name in ("all", "some", "third"):
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
    """One slot, two adapters kept in memory: each new adapter evicts the
    oldest, a removed one is loaded again at its next request, and
    nothing compiles."""
    one = [(list(range(7, 27)), 8, None)]
    with lora_llm(tiny_llama, "cb", "eager", max_loras=1,
                  max_cpu_loras=2) as llm:
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


def test_bad_adapters_are_refused_and_the_engine_serves_on(
        tiny_llama, adapters, want, tmp_path):
    from vllm.lora.request import LoRARequest
    prompt = list(range(5, 20))
    good = [(prompt, 8, "all"), (prompt, 8, None)]
    missing = LoRARequest("missing", 50, str(tmp_path / "nowhere"))
    with lora_llm(tiny_llama, "cb", "eager") as llm:
        refusals = {}
        for name in ("rank16", "alien", "corrupt"):
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
    assert "'rank16'" in refusals["rank16"]
    assert "16" in refusals["rank16"] and "8" in refusals["rank16"]
    assert "does not fit this base model" in refusals["alien"]
    assert "was it trained for another model?" in refusals["alien"]
    assert "'corrupt' cannot be served" in refusals["corrupt"]
    assert "no adapter folder" in refusals["missing"]


def test_fms_model_code_is_refused_at_start_up(tiny_llama):
    args = dict(LORA_ARGS, model_impl="auto")
    with pytest.raises(NotImplementedError, match="--model-impl vllm"):
        with lora_llm(tiny_llama, "cb", "eager", **args):
            pass
