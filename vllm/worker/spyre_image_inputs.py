"""ImageEmbeds: the images of a continuous-batching prefill, as the
embeddings of its positions.

vLLM's multimodal processor (run by the engine as it adds a request)
expands each image's placeholder in the prompt to the image's number of
tokens and keeps the image's tensors; the scheduler hands them to every
prefill step of the request (``SequenceGroupMetadata.multi_modal_data``).
A model that takes images (``ModelCode.embeds_prompts``) prefills on
embeddings, so the runner gives each prefill chunk the embeddings of its
positions (``chunks``): the model code's vision tower and projector run
on the request's images once, eagerly, merged at the placeholders with the
other tokens' embeddings (``ModelCode.prompt_embeds``), and are kept
until the request's last prefill chunk; a left-padded slot gets the pad
token's embedding, and the outputs a recomputed (preempted) sequence
holds their ids' own.  A prefill without images gets its ids' embeddings in
the model (``SpyreCBCausalLM.forward``), so one prefill graph serves
both.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.platforms import current_platform


class ImageEmbeds:
    """Each prefilling request's embeddings, while its prefill lasts."""

    def __init__(self, code, pad_id: int) -> None:
        self.code = code
        self.pad_id = pad_id
        #: Per request: (its length when embedded, ``[n, hidden]``).
        self.kept: dict[str, tuple[int, torch.Tensor]] = {}

    def chunks(self, meta, tokens: list[int], chunks: PagedInputs,
               start: int, end: int) -> PagedInputs:
        """``chunks`` (positions ``start`` to ``end - 1`` of ``tokens``,
        left-padded) with their embeddings, where the request has
        images."""
        if not meta.multi_modal_data:
            return chunks
        (data, ) = meta.seq_data.values()
        embeds = self._embeds(meta.request_id, tokens,
                              data.get_prompt_len(), meta.multi_modal_data)
        rows, length = chunks.input_ids.shape
        pad = rows * length - (end - start)
        pad_embed = self.code.embed(torch.tensor([[self.pad_id]]))[0, 0]
        flat = torch.cat([pad_embed.expand(pad, -1), embeds[start:end]])
        if end == len(tokens):
            self.kept.pop(meta.request_id, None)
        return dataclasses.replace(
            chunks, inputs_embeds=flat.view(rows, length, -1).contiguous())

    @current_platform.inference_mode()
    def _embeds(self, request_id: str, tokens: list[int], prompt_len: int,
                images) -> torch.Tensor:
        """The prompt's embeddings with its images, then those of the
        outputs a recomputed sequence holds, as text (a generated token
        that is a placeholder's id is a token like any other)."""
        kept = self.kept.get(request_id)
        if kept is None or kept[0] != len(tokens):
            embeds = self.code.prompt_embeds(tokens[:prompt_len], images)
            if len(tokens) > prompt_len:
                outputs = torch.tensor([tokens[prompt_len:]])
                embeds = torch.cat([embeds, self.code.embed(outputs)[0]])
            kept = (len(tokens), embeds)
            self.kept[request_id] = kept
        return kept[1]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.kept.pop(request_id, None)
