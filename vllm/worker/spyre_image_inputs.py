"""ImageEmbeds: the images of a continuous-batching prefill, as the
embeddings of its positions.

vLLM's multimodal processor (run by the engine as it adds a request)
expands each image's placeholder in the prompt to the image's number of
tokens and keeps the image's tensors; the scheduler hands them to every
prefill step of the request (``SequenceGroupMetadata.multi_modal_data``).
A model that takes images (``ModelCode.embeds_prompts``) prefills on
embeddings.  The driver puts what a prefill step needs in the step's
input (``prefill``: an ``ImagePrefill``, broadcast to every rank with
the step), and every rank gives the step's prefill chunks the embeddings
of their positions (``chunks``), since under tensor parallelism the
vision tower's layers are split over the ranks as the language model's
are: the model code's vision tower and projector run on the request's
images once, eagerly, merged at the placeholders with the other tokens'
embeddings (``ModelCode.prompt_embeds``), and are kept while the request
prefills (one prefill runs at a time); a left-padded slot gets the pad
token's embedding, and the outputs a recomputed (preempted) sequence
holds their ids' own.  A prefill without images gets its ids' embeddings
in the model (``SpyreCBCausalLM.forward``), so one prefill graph serves
both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.platforms import current_platform


@dataclass(frozen=True)
class ImagePrefill:
    """What a prefill step's images need on every rank: the sequence's
    tokens (its outputs too, when recomputed), how many are the prompt's,
    the positions the step computes, and the images' tensors."""

    request_id: str
    tokens: tuple[int, ...]
    prompt_len: int
    start: int
    end: int
    images: Any  # vLLM's MultiModalKwargs


class ImageEmbeds:
    """The prefilling request's embeddings, while its prefill lasts."""

    def __init__(self, code, pad_id: int) -> None:
        self.code = code
        self.pad_id = pad_id
        #: (request, its length when embedded, ``[n, hidden]``).
        self.kept: Optional[tuple[str, int, torch.Tensor]] = None

    def prefill(self, meta, tokens: list[int], start: int,
                end: int) -> Optional[ImagePrefill]:
        """The step input's images of a prefill step (driver); None
        without images."""
        if not meta.multi_modal_data:
            return None
        (data, ) = meta.seq_data.values()
        return ImagePrefill(meta.request_id, tuple(tokens),
                            data.get_prompt_len(), start, end,
                            meta.multi_modal_data)

    def chunks(self, chunks: PagedInputs,
               prefill: ImagePrefill) -> PagedInputs:
        """``chunks`` (positions ``start`` to ``end - 1``, left-padded)
        with their embeddings."""
        embeds = self._embeds(prefill)
        rows, length = chunks.input_ids.shape
        pad = rows * length - (prefill.end - prefill.start)
        pad_embed = self.code.embed(torch.tensor([[self.pad_id]]))[0, 0]
        flat = torch.cat([pad_embed.expand(pad, -1),
                          embeds[prefill.start:prefill.end]])
        if prefill.end == len(prefill.tokens):
            self.kept = None
        return dataclasses.replace(
            chunks, inputs_embeds=flat.view(rows, length, -1).contiguous())

    @current_platform.inference_mode()
    def _embeds(self, prefill: ImagePrefill) -> torch.Tensor:
        """The prompt's embeddings with its images, then those of the
        outputs a recomputed sequence holds, as text (a generated token
        that is a placeholder's id is a token like any other)."""
        tokens, prompt_len = prefill.tokens, prefill.prompt_len
        key = (prefill.request_id, len(tokens))
        if self.kept is None or self.kept[:2] != key:
            embeds = self.code.prompt_embeds(list(tokens[:prompt_len]),
                                             prefill.images)
            if len(tokens) > prompt_len:
                outputs = torch.tensor([tokens[prompt_len:]])
                embeds = torch.cat([embeds, self.code.embed(outputs)[0]])
            self.kept = (*key, embeds)
        return self.kept[2]
