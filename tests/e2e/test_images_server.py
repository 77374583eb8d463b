"""Images through ``vllm serve`` (the MQLLMEngine OpenAI server) on
loopback: the tiny LLaVA-NeXT answers a chat message holding a base64
image as transformers answers the same prompt and image, through the
openai client and LangChain's image message form, and two images in one
message likewise, and a local file under ``--allowed-local-media-path``;
a text-only chat is answered; an image that does not decode, too many
images, a local file outside the allowed folder and a prompt longer than
the model's length with its image's tokens get a 400 naming the problem,
and the server serves on; under static batching, an image chat is
answered and one longer than every warm-up shape gets a 400."""
from __future__ import annotations

import base64
import io

import pytest

from spyre_support.envs import cb_env, spyre_env
from spyre_support.server import Server, openai_client
from spyre_support.tiny_vision import build_tiny_llava_next, image

MAX_TOKENS = 10
QUESTION = "the spyre card"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The folder ``--allowed-local-media-path`` names, with a PNG."""
    folder = tmp_path_factory.mktemp("media")
    image(40, 48, seed=7).save(folder / "card.png")
    return folder


@pytest.fixture(scope="module")
def server(llava, media):
    args = ("--max-num-seqs", "4", "--max-model-len", "256",
            "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", str(media))
    with Server(llava, cb_env("eager"), args=args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return ("data:image/png;base64," +
            base64.b64encode(buffer.getvalue()).decode())


def transformers_answer(model, picture, question: str) -> list[int]:
    """transformers' greedy ids answering the chat prompt vLLM renders
    for a message of an image (or a list of images) and ``question``
    (each placeholder on a line of its own before the text, in the tiny
    tokenizer's chat template)."""
    import torch
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration
    processor = AutoProcessor.from_pretrained(model)
    hf = LlavaNextForConditionalGeneration.from_pretrained(model).eval()
    pictures = picture if isinstance(picture, list) else [picture]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user",
          "content": "<image>\n" * len(pictures) + question}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(images=pictures, text=prompt, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        ids = hf.generate(**inputs, max_new_tokens=MAX_TOKENS,
                          do_sample=False)
    return ids[0, inputs["input_ids"].shape[1]:].tolist()


def text_of(model, ids: list[int]) -> str:
    """The ids' text as a stream ends it: an unfinished character
    withheld."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model).decode(ids).rstrip("\ufffd")


def image_message(picture, question: str = QUESTION) -> dict:
    return {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": question}]}


def chat(client, server, messages, **extra):
    extra.setdefault("extra_body", dict(ignore_eos=True))
    return client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS,
        temperature=0, **extra)


def test_a_base64_image_is_answered_as_transformers_answers(
        server, client, llava):
    picture = image(48, 40, seed=1)
    reply = chat(client, server, [image_message(picture)], logprobs=True,
                 extra_body=dict(ignore_eos=True,
                                 return_tokens_as_token_ids=True))
    ids = [int(t.token.removeprefix("token_id:"))
           for t in reply.choices[0].logprobs.content]
    assert ids == transformers_answer(llava, picture, QUESTION)
    assert reply.usage.prompt_tokens > 40  # the image's tokens


def test_two_images_in_one_message_are_answered_as_transformers_answers(
        server, client, llava):
    """Two ``image_url`` parts of different sizes
    (``--limit-mm-per-prompt '{"image": 2}'``)."""
    pictures = [image(48, 40, seed=5), image(24, 64, seed=6)]
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}}
               for p in pictures] + [{"type": "text", "text": QUESTION}]
    reply = chat(client, server, [{"role": "user", "content": content}],
                 logprobs=True, extra_body=dict(
                     ignore_eos=True, return_tokens_as_token_ids=True))
    ids = [int(t.token.removeprefix("token_id:"))
           for t in reply.choices[0].logprobs.content]
    assert ids == transformers_answer(llava, pictures, QUESTION)


def test_a_local_file_under_the_allowed_path_is_answered(server, client,
                                                         llava, media):
    from PIL import Image
    content = [{"type": "image_url",
                "image_url": {"url": (media / "card.png").as_uri()}},
               {"type": "text", "text": QUESTION}]
    reply = chat(client, server, [{"role": "user", "content": content}],
                 logprobs=True, extra_body=dict(
                     ignore_eos=True, return_tokens_as_token_ids=True))
    ids = [int(t.token.removeprefix("token_id:"))
           for t in reply.choices[0].logprobs.content]
    picture = Image.open(media / "card.png").convert("RGB")
    assert ids == transformers_answer(llava, picture, QUESTION)


def test_two_images_answer_differently(server, client):
    first = chat(client, server, [image_message(image(32, 32, seed=2))])
    second = chat(client, server, [image_message(image(32, 32, seed=3))])
    assert first.choices[0].message.content != \
        second.choices[0].message.content


def test_langchain_image_message(server, llava):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    picture = image(64, 24, seed=4)
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused",
                     model=server.model, temperature=0,
                     max_tokens=MAX_TOKENS,
                     extra_body=dict(ignore_eos=True))
    answer = llm.invoke([HumanMessage(content=[
        {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": QUESTION}])])
    assert answer.content == text_of(
        llava, transformers_answer(llava, picture, QUESTION))


def test_a_text_only_chat_is_answered(server, client):
    reply = chat(client, server, [{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content


@pytest.mark.parametrize("case, names", [
    ("undecodable", "cannot identify image file"),
    ("three images", "At most 2 image(s) may be provided in one prompt"),
    ("local file", "must be a subpath of `--allowed-local-media-path`"),
    ("too long", "maximum context length is 256 tokens"),
])
def test_bad_images_are_400_and_the_server_serves_on(case, names, server,
                                                     client):
    import openai
    content = {
        "undecodable": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
            {"type": "text", "text": QUESTION}],
        "three images": image_message(image(32, 32))["content"] * 3,
        "local file": [{"type": "image_url", "image_url": {
            "url": "file:///etc/hostname"}},
            {"type": "text", "text": QUESTION}],
        "too long": image_message(image(64, 64), "one two " * 120)[
            "content"],
    }[case]
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, server, [{"role": "user", "content": content}])
    assert names in str(error.value)
    assert chat(client, server, [image_message(image(32, 32))]).choices


@pytest.fixture(scope="module")
def static_server(llava):
    """Static batching, its prompt shapes sized for one image's tokens."""
    env = spyre_env("eager", [64, 128], [MAX_TOKENS] * 2, [2, 2])
    with Server(llava, env) as srv:
        yield srv


def test_static_batching_answers_as_transformers_and_refuses_by_length(
        static_server, llava):
    """Under static batching an image chat is answered as transformers
    answers it; a chat whose image's tokens make it longer than every
    warm-up shape gets a 400 naming its length, and the server serves
    on."""
    import openai
    client = openai_client(static_server)
    picture = image(48, 40, seed=1)
    reply = chat(client, static_server, [image_message(picture)],
                 logprobs=True, extra_body=dict(
                     ignore_eos=True, return_tokens_as_token_ids=True))
    ids = [int(t.token.removeprefix("token_id:"))
           for t in reply.choices[0].logprobs.content]
    assert ids == transformers_answer(llava, picture, QUESTION)
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, static_server,
             [image_message(image(64, 64), "one two " * 14)])
    assert "fits none of the compiled Spyre warm-up shapes" in str(
        error.value)
    length = int(str(error.value).split("prompt length ")[1].split(",")[0])
    assert length > 128
    assert chat(client, static_server,
                [image_message(picture)]).choices[0].message.content
