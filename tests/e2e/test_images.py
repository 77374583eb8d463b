"""Images in, text out: a vision-language model (LLaVA-NeXT, Granite
Vision's architecture; a tiny random one built here) on vLLM's model code
under continuous batching, offline.

Prompts with an image of each of several sizes and aspect ratios (one
tile, and any-resolution grids of two and four tiles), text-only prompts
and both in one batch: the prompt ids equal transformers' processor's
(each placeholder expanded to the image's tokens) and the greedy ids
transformers' ``generate``, on `eager` and `inductor` with nothing
compiled after warm-up, with chunked prefill, whose chunks split an
image's tokens, and with sequences preempted and recomputed.  What does
not run yet is refused at start-up, naming it.
"""
from __future__ import annotations

import pytest

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.tiny_vision import build_tiny_llava_next, image

MAX_TOKENS = 12
#: (prompt, image size or None): one tile, two tiles wide, two tall, four.
CASES = [("<image> the spyre card", (32, 32)),
         ("a batch of <image> one two", (64, 24)),
         ("<image>\nthe model", (20, 70)),
         ("the cache <image>", (60, 60)),
         ("the spyre card serve request", None)]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def reference(llava):
    """transformers' prompt ids and greedy ids for each case."""
    import torch
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration
    processor = AutoProcessor.from_pretrained(llava)
    model = LlavaNextForConditionalGeneration.from_pretrained(llava).eval()
    out = []
    for i, (prompt, size) in enumerate(CASES):
        images = None if size is None else image(*size, seed=i)
        inputs = processor(images=images, text=prompt, return_tensors="pt")
        inputs.pop("token_type_ids", None)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        prompt_ids = inputs["input_ids"][0].tolist()
        out.append((prompt_ids, ids[0, len(prompt_ids):].tolist()))
    return out


def requests():
    from vllm import SamplingParams
    prompts = [{"prompt": prompt} if size is None else
               {"prompt": prompt,
                "multi_modal_data": {"image": image(*size, seed=i)}}
               for i, (prompt, size) in enumerate(CASES)]
    return prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                   ignore_eos=True)


def run(model, backend: str, **kwargs) -> dict:
    prompts, params = requests()
    with spyre_llm(model, cb_env(backend), max_num_seqs=4,
                   max_model_len=256, **kwargs) as llm:
        before = compile_count()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return dict(prompt_ids=[o.prompt_token_ids for o in outs],
                    ids=[list(o.outputs[0].token_ids) for o in outs],
                    compiled=compile_count() - before,
                    preemptions=llm.llm_engine.scheduler[0]
                    .num_cumulative_preemption)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_greedy_ids_equal_transformers(backend, llava, reference):
    got = run(llava, backend)
    assert got["prompt_ids"] == [p for p, _ in reference]
    assert got["ids"] == [ids for _, ids in reference]
    assert got["compiled"] == 0


def test_chunked_prefill_splits_an_images_tokens(llava, reference):
    got = run(llava, "eager", enable_chunked_prefill=True,
              max_num_batched_tokens=64)
    assert max(len(p) for p in got["prompt_ids"]) > 64
    assert got["ids"] == [ids for _, ids in reference]


def test_a_preempted_image_request_is_recomputed_with_its_image(
        llava, reference):
    """A pool of 4 blocks for requests of 2 each: sequences are preempted
    and recomputed, their images embedded again."""
    got = run(llava, "eager", num_gpu_blocks_override=4)
    assert got["preemptions"] > 0
    assert got["ids"] == [ids for _, ids in reference]


@pytest.mark.parametrize("case, message", [
    ("static", "set VLLM_SPYRE_USE_CB=1"),
    ("tensor parallel", "tensor_parallel_size=3"),
])
def test_what_does_not_run_yet_is_refused(case, message, llava):
    import os
    from unittest import mock

    from vllm import EngineArgs
    env, extra = {
        "static": (spyre_env("eager", [64], [16], [1]), {}),
        "tensor parallel": (cb_env("eager"), {"tensor_parallel_size": 3}),
    }[case]
    with mock.patch.dict(os.environ, env):
        with pytest.raises((ValueError, NotImplementedError), match=message):
            EngineArgs(model=str(llava), max_model_len=256,
                       **extra).create_engine_config()


def test_prefix_caching_stays_off(llava):
    """vLLM's V0 block hashes hold token ids only (two prompts with the
    same text and different images would share blocks): vLLM turns
    ``--enable-prefix-caching`` off for a multimodal model."""
    import os
    from unittest import mock

    from vllm import EngineArgs
    with mock.patch.dict(os.environ, cb_env("eager")):
        config = EngineArgs(model=str(llava), max_model_len=256,
                            enable_prefix_caching=True).create_engine_config()
    assert not config.cache_config.enable_prefix_caching
