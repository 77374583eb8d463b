"""ImageEmbeds (``vllm.worker.spyre_image_inputs``): a prefill chunk's
embeddings, laid out as its positions (the pad token's in left-padded
slots), the images embedded once per sequence and reused only by the
same sequence's next chunk: never by another request with the same
tokens, even after a prefill that stopped half way (an abort, a
preemption)."""
from __future__ import annotations

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.worker.spyre_image_inputs import ImageEmbeds, ImagePrefill

HIDDEN = 3


class Code:
    """Model code whose embedding of token t is [t, t, t] and whose
    images add their value to every prompt position."""

    def __init__(self) -> None:
        self.embedded = 0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.unsqueeze(-1).float().expand(*ids.shape, HIDDEN)

    def prompt_embeds(self, tokens: torch.Tensor, images: dict):
        self.embedded += 1
        return self.embed(tokens) + images["pixel_values"]


def chunk(rows: int, length: int) -> PagedInputs:
    ids = torch.zeros(rows, length, dtype=torch.long)
    return PagedInputs(ids, ids, ids, ids[:, :1], ids)


def step(tokens, start: int, end: int) -> ImagePrefill:
    return ImagePrefill(torch.tensor(tokens), prompt_len=len(tokens),
                        start=start, end=end)


def test_a_chunk_holds_its_positions_embeddings_after_the_padding():
    code = Code()
    images = ImageEmbeds(code, pad_id=7)
    tokens = list(range(10, 16))
    out = images.chunks(chunk(1, 8), step(tokens, 0, 6),
                        {"pixel_values": torch.tensor(100.0)})
    got = out.inputs_embeds[0, :, 0].tolist()
    assert got == [7, 7, *[t + 100 for t in tokens]]


def test_only_the_same_sequences_next_chunk_reuses_the_embeddings():
    code = Code()
    images = ImageEmbeds(code, pad_id=0)
    tokens = list(range(1, 9))
    one, two = ({"pixel_values": torch.tensor(v)} for v in (1.0, 2.0))
    images.chunks(chunk(1, 4), step(tokens, 0, 4), one)
    images.chunks(chunk(1, 4), step(tokens, 4, 8), one)  # its next chunk
    assert code.embedded == 1
    # A first chunk that stopped half way, then another request of the
    # same tokens with another image: embedded anew.
    images.chunks(chunk(1, 4), step(tokens, 0, 4), one)
    out = images.chunks(chunk(1, 4), step(tokens, 0, 4), two)
    assert code.embedded == 3
    assert out.inputs_embeds[0, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0]


def test_several_images_lists_are_gathered_in_order():
    """Images of different sizes come as lists (per request, per image):
    the step input carries each tensor under its path, and the model's
    keyword arguments gather them again, the eleventh after the tenth."""
    pixels = [torch.full((2, ), float(i)) for i in range(11)]
    flat = {f"pixel_values/0/{i}": t for i, t in enumerate(pixels)}
    flat["image_sizes"] = torch.tensor([[4, 4]])
    shuffled = dict(reversed(list(flat.items())))
    kwargs = ImageEmbeds.kwargs(shuffled)
    assert list(kwargs) == ["image_sizes", "pixel_values"]
    assert len(kwargs["pixel_values"]) == 1
    assert [t[0].item() for t in kwargs["pixel_values"][0]] == list(range(11))
    assert torch.equal(kwargs["image_sizes"], flat["image_sizes"])


def test_a_prefill_past_its_images_runs_no_vision_tower():
    """After cached blocks (prefix caching) or earlier chunks, positions
    left with no image placeholder make a text prefill: no image fields
    in the step input, so no rank runs the tower; positions left that
    hold one, or a prefill from the start, carry the images."""
    from types import SimpleNamespace
    images = ImageEmbeds(Code(), pad_id=0, image_token=4)
    tokens = [1, 4, 4, 4, 5, 6, 7, 8]
    meta = SimpleNamespace(
        multi_modal_data={"pixel_values": torch.zeros(1)},
        seq_data={0: SimpleNamespace(get_prompt_len=lambda: len(tokens))})
    images.tensors = lambda data: {"pixel_values": data["pixel_values"]}
    assert images.prefill(meta, tokens, 4, 8) == {}
    assert images.prefill(meta, tokens + [4], 8, 9) == {}  # an output
    for start in (0, 3):
        fields = images.prefill(meta, tokens, start, 8)
        assert fields["prefill_images"].start == start
