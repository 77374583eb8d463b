"""Images in, text out: vision-language models (LLaVA-NeXT, Granite
Vision's architecture, and Mistral 3 with its Pixtral vision model; tiny
random ones built here) on vLLM's model code under continuous batching,
offline.

Prompts with an image of each of several sizes and aspect ratios (for
LLaVA-NeXT one tile and any-resolution grids of two and four tiles; for
Pixtral as many patches as the image's own size holds), text-only prompts
and both in one batch: the prompt ids equal transformers' processor's
(each placeholder expanded to the image's tokens) and the greedy ids
transformers' ``generate``, on `eager` and `inductor` with nothing
compiled after warm-up, with chunked prefill, whose chunks split an
image's tokens, with sequences preempted and recomputed, and over two
tensor-parallel ranks.  What does not run yet is refused at start-up,
naming it; prompt log-probabilities of a prompt with images are refused
with the request.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

from spyre_support.engines import compile_count, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.tiny_vision import (build_tiny_llava_next,
                                       build_tiny_mistral3, image)

MAX_TOKENS = 48
#: Each family's builder, image placeholder, and a block pool too small
#: for the cases' sequences (each needs 2 or 3 blocks by its end).
FAMILIES = {"llava_next": (build_tiny_llava_next, "<image>", 4),
            "mistral3": (build_tiny_mistral3, "[IMG]", 3)}
#: (prompt, image size, None or a list of sizes): for LLaVA-NeXT one
#: tile, two tiles wide, two tall, four (after 48 tokens of text: a
#: 64-token prefill chunk ends inside the image), no image, and two
#: images of different sizes.
CASES = [("{image} the spyre card", (32, 32)),
         ("a batch of {image} one two", (64, 24)),
         ("{image}\nthe model", (20, 70)),
         ("one two three " * 16 + "{image}", (60, 60)),
         ("the spyre card serve request", None),
         ("{image} left and right {image}", [(32, 32), (20, 70)])]
#: Images a prompt may hold (``--limit-mm-per-prompt``).
LIMIT = {"image": 2}


class Checkpoint(NamedTuple):
    path: Path
    placeholder: str
    small_pool: int


@pytest.fixture(scope="module", params=list(FAMILIES))
def llava(request, tmp_path_factory):
    """The tiny checkpoint of each family, with its placeholder."""
    build, placeholder, small_pool = FAMILIES[request.param]
    return Checkpoint(build(tmp_path_factory.mktemp(request.param)),
                      placeholder, small_pool)


def cases(model):
    return [(prompt.format(image=model.placeholder), size)
            for prompt, size in CASES]


@pytest.fixture(scope="module")
def reference(llava):
    """transformers' prompt ids and greedy ids for each case."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(llava.path)
    model = AutoModelForImageTextToText.from_pretrained(llava.path).eval()
    out = []
    for i, (prompt, size) in enumerate(cases(llava)):
        images = images_of(size, i)
        inputs = processor(images=images, text=prompt, return_tensors="pt")
        inputs.pop("token_type_ids", None)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        prompt_ids = inputs["input_ids"][0].tolist()
        out.append((prompt_ids, ids[0, len(prompt_ids):].tolist()))
    return out


def images_of(size, seed: int):
    """A case's image, its list of images, or None."""
    if isinstance(size, list):
        return [image(*one, seed=10 * seed + j) for j, one in enumerate(size)]
    return None if size is None else image(*size, seed=seed)


def requests(model):
    from vllm import SamplingParams
    prompts = [{"prompt": prompt} if size is None else
               {"prompt": prompt,
                "multi_modal_data": {"image": images_of(size, i)}}
               for i, (prompt, size) in enumerate(cases(model))]
    return prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                   ignore_eos=True)


def run(model, backend: str, **kwargs) -> dict:
    prompts, params = requests(model)
    with spyre_llm(model.path, cb_env(backend), max_num_seqs=4,
                   max_model_len=256, limit_mm_per_prompt=LIMIT,
                   **kwargs) as llm:
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
    """A pool too small for the running sequences: they are preempted
    and recomputed, their images embedded again, their outputs (which
    may hold a placeholder's id: the random model generates it) as
    text."""
    got = run(llava, "eager", num_gpu_blocks_override=llava.small_pool)
    assert got["preemptions"] > 0
    assert got["ids"] == [ids for _, ids in reference]


def test_tensor_parallel_2_equals_transformers(llava, reference):
    """The vision tower's heads and the language model's split over two
    ranks; every rank embeds the images the driver's step input holds."""
    got = run(llava, "eager", tensor_parallel_size=2)
    assert got["ids"] == [ids for _, ids in reference]


def test_bad_image_requests_are_refused_and_the_engine_serves_on(
        llava, reference):
    """Prompt log-probabilities of a prompt with images, a prompt whose
    text holds a second placeholder for its one image, and more images
    than ``--limit-mm-per-prompt``: refused by name before anything is
    queued."""
    from vllm import SamplingParams
    prompts, params = requests(llava)
    stray = dict(prompts[0],
                 prompt=f"{llava.placeholder} {prompts[0]['prompt']}")
    three = {"prompt": llava.placeholder * 3,
             "multi_modal_data": {"image": [image(32, 32)] * 3}}
    with spyre_llm(llava.path, cb_env("eager"), max_num_seqs=4,
                   max_model_len=256, limit_mm_per_prompt=LIMIT) as llm:
        with pytest.raises(ValueError, match="prompt_logprobs=1 of a "
                           "prompt with images is not supported"):
            llm.generate(prompts[0], SamplingParams(prompt_logprobs=1),
                         use_tqdm=False)
        with pytest.raises(ValueError, match="image placeholder tokens"):
            llm.generate(stray, params, use_tqdm=False)
        with pytest.raises(ValueError, match="At most 2 image"):
            llm.generate(three, params, use_tqdm=False)
        out = llm.generate(prompts[0], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == reference[0][1]


#: Static batching's warm-up shapes: the cases' prompts, their images'
#: tokens counted, fit the larger.
STATIC_SHAPES = ([64, 192], [MAX_TOKENS] * 2, [4, 4])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_static_batching_equals_transformers(backend, llava, reference):
    """Static batches of image and text-only prompts, padded to shapes
    that hold the images' tokens; a prompt whose image makes it longer
    than every shape is refused naming its length, and the engine
    serves on."""
    prompts, params = requests(llava)
    long = {"prompt": "one two three " * 60 + llava.placeholder,
            "multi_modal_data": {"image": image(60, 60)}}
    with spyre_llm(llava.path, spyre_env(backend, *STATIC_SHAPES),
                   limit_mm_per_prompt=LIMIT) as llm:
        before = compile_count()
        outs = llm.generate(prompts, params, use_tqdm=False)
        compiled = compile_count() - before
        # Spyre's scheduler ("fits none of the compiled Spyre warm-up
        # shapes") or, past the largest shape's length, vLLM's own check.
        with pytest.raises(ValueError, match=r"fits none of the compiled "
                           r"|is longer than the maximum model length") \
                as refused:
            llm.generate(long, params, use_tqdm=False)
        again = llm.generate(prompts[0], params, use_tqdm=False)[0]
    # The length counts the image's tokens: the text alone fits.
    assert int(re.search(r"length (\d+)", str(refused.value))[1]) > 192
    assert max(len(o.prompt_token_ids) for o in outs) > 64
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        ids for _, ids in reference]
    assert list(again.outputs[0].token_ids) == reference[0][1]
    assert compiled == 0


def test_static_batching_over_two_ranks(llava, reference):
    """The driver's step input carries each image row's tensors; every
    rank embeds them."""
    prompts, params = requests(llava)
    with spyre_llm(llava.path, spyre_env("eager", *STATIC_SHAPES),
                   limit_mm_per_prompt=LIMIT, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        ids for _, ids in reference]


@pytest.mark.parametrize("case, message", [
    ("vision heads", "its attention heads \\(num_attention_heads = 2\\)"),
    ("LoRA", "LoRA adapters on LlavaNext|LoRA adapters on Mistral3"),
])
def test_what_does_not_run_yet_is_refused(case, message, llava):
    import os
    from unittest import mock

    from vllm import EngineArgs
    env, extra = {
        "vision heads": (cb_env("eager"), {"tensor_parallel_size": 4}),
        "LoRA": (cb_env("eager"), {"enable_lora": True}),
    }[case]
    with mock.patch.dict(os.environ, env):
        with pytest.raises((ValueError, NotImplementedError), match=message):
            EngineArgs(model=str(llava.path), max_model_len=256,
                       **extra).create_engine_config()


def test_prefix_caching_keys_blocks_by_the_images(llava):
    """The same text with another image shares no cached block and gets
    its own image's answer; with the same image again it reuses the
    cached blocks, image and all."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vllm import SamplingParams
    prompt = f"{llava.placeholder} " + "one two three " * 30
    # The same size: the same number of placeholder tokens.
    pictures = [image(32, 32, seed=5), image(32, 32, seed=6)]
    processor = AutoProcessor.from_pretrained(llava.path)
    model = AutoModelForImageTextToText.from_pretrained(llava.path).eval()
    expected = []
    for picture in pictures:
        inputs = processor(images=picture, text=prompt, return_tensors="pt")
        inputs.pop("token_type_ids", None)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        expected.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    with spyre_llm(llava.path, cb_env("eager"), max_num_seqs=4,
                   max_model_len=256, enable_prefix_caching=True) as llm:
        assert llm.llm_engine.cache_config.enable_prefix_caching
        outs = [llm.generate({"prompt": prompt,
                              "multi_modal_data": {"image": pictures[i]}},
                             params, use_tqdm=False)[0]
                for i in (0, 1, 0)]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        expected[0], expected[1], expected[0]]
    assert len(outs[0].prompt_token_ids) > 64
    assert [o.num_cached_tokens for o in outs[:2]] == [0, 0]
    assert outs[2].num_cached_tokens >= 64
