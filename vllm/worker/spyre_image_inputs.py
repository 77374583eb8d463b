"""The images of a prefill, as the embeddings of its positions:
``ImageEmbeds`` under continuous batching, ``static_prefill`` and
``static_embeds`` under static batching.

vLLM's multimodal processor (run by the engine as it adds a request)
expands each image's placeholder in the prompt to the image's number of
tokens and keeps the image's tensors; the scheduler hands them to every
prefill step of the request (``SequenceGroupMetadata.multi_modal_data``).
A model that takes images (``ModelCode.embeds_prompts``) prefills on
embeddings.  The driver puts what a prefill step needs in the step's
input (``prefill``: an ``ImagePrefill``, broadcast to every rank with
the step, ``tensors`` the images' own), and every rank gives the step's
prefill chunks the embeddings of their positions (``chunks``), since
under tensor parallelism the
vision tower's layers are split over the ranks as the language model's
are: the model code's vision tower and projector run on the request's
images once, eagerly, merged at the placeholders with the other tokens'
embeddings (``ModelCode.prompt_embeds``), and are kept while the request
prefills (one prefill runs at a time); a left-padded slot gets the pad
token's embedding, and the outputs a recomputed (preempted) sequence
holds their ids' own.  A prefill without images gets its ids' embeddings
in the model (``SpyreCBCausalLM.forward``), so one prefill graph serves
both.

A static batch's prefill holds every request of the batch, each row
left-padded to the warm-up shape's prompt length: the driver puts each
image request's row, prompt length and tensors in the step input
(``static_prefill``), and every rank embeds the rows, the image rows with
their images (``static_embeds``).  A model that takes images prefills its
static shapes on embeddings too (``SpyreStaticCausalLM.forward``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.platforms import current_platform


def flat_tensors(kwargs) -> dict[str, torch.Tensor]:
    """A mapping of names to tensors or (nested) lists of them, each tensor
    under its path (``pixel_values/0/1``), contiguous: Mistral 3's
    processor crops each image's pixels in a view, and the broadcast sends
    a tensor's storage as laid out."""
    flat: dict[str, torch.Tensor] = {}

    def put(path: str, value) -> None:
        if isinstance(value, torch.Tensor):
            flat[path] = value.contiguous()
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                put(f"{path}/{i}", item)
        else:
            raise ValueError(f"image input {path} is a "
                             f"{type(value).__name__}, not a tensor")

    for name in kwargs:
        put(name, kwargs[name])
    return flat


def has_images(meta) -> bool:
    """Whether a step's request holds images: vLLM hands a text-only
    request of a multimodal model an empty ``MultiModalKwargs``, which is
    true as a value."""
    data = meta.multi_modal_data
    return data is not None and any(True for _ in data.keys())


@dataclass(frozen=True)
class ImagePrefill:
    """What a prefill step's images need on every rank, besides the
    images' tensors (``ImageEmbeds.tensors``): the sequence's tokens (its
    outputs too, when recomputed), how many are the prompt's, and the
    positions the step computes."""

    tokens: torch.Tensor  # [n] int64
    prompt_len: int
    start: int
    end: int


class ImageEmbeds:
    """The prefilling request's embeddings, while its prefill lasts."""

    def __init__(self, code, pad_id: int,
                 image_token: Optional[int] = None) -> None:
        self.code = code
        self.pad_id = pad_id
        #: The placeholder id of an image's features (the config's
        #: ``image_token_index``).
        self.image_token = image_token
        #: (the tokens and prompt length embedded, ``[n, hidden]``).
        self.kept: Optional[tuple[ImagePrefill, torch.Tensor]] = None

    def prefill(self, meta, tokens: list[int], start: int,
                end: int) -> dict:
        """The step input's fields of a prefill step's images (driver):
        ``prefill_images`` and ``prefill_image_tensors``; none without
        images, nor when the positions left to compute (after blocks
        prefix caching found, or chunks already run) hold no image
        feature: the step is then a text prefill, and the vision tower
        does not run."""
        if not has_images(meta):
            return {}
        (data, ) = meta.seq_data.values()
        if (start > 0 and self.image_token is not None and self.image_token
                not in tokens[start:data.get_prompt_len()]):
            return {}
        return dict(
            prefill_images=ImagePrefill(
                torch.tensor(tokens, dtype=torch.long),
                data.get_prompt_len(), start, end),
            prefill_image_tensors=self.tensors(meta.multi_modal_data))

    @staticmethod
    def tensors(images) -> dict[str, torch.Tensor]:
        """vLLM's multimodal inputs of one request as the model's keyword
        arguments, flattened to tensors (the step input carries tensors
        only): several images of different sizes come as lists, each
        tensor of a list kept under its path (``pixel_values/0/1``)."""
        from vllm.multimodal import MultiModalKwargs
        return flat_tensors(MultiModalKwargs.as_kwargs(
            MultiModalKwargs.batch([images]), device="cpu"))

    @staticmethod
    def kwargs(flat: dict[str, torch.Tensor]) -> dict:
        """The model's keyword arguments of ``tensors``' flattened form:
        each path's tensors gathered into lists again, in order."""
        kwargs: dict = {}
        for path in sorted(flat, key=lambda p: [
                int(part) if part.isdigit() else part
                for part in p.split("/")]):
            name, *where = path.split("/")
            if not where:
                kwargs[name] = flat[path]
                continue
            holder = kwargs.setdefault(name, [])
            for i in where[:-1]:
                if len(holder) <= int(i):
                    holder.append([])
                holder = holder[int(i)]
            holder.append(flat[path])
        return kwargs

    def chunks(self, chunks: PagedInputs, prefill: ImagePrefill,
               tensors: dict[str, torch.Tensor]) -> PagedInputs:
        """``chunks`` (positions ``start`` to ``end - 1``, left-padded)
        with their embeddings."""
        embeds = self._embeds(prefill, tensors)
        rows, length = chunks.input_ids.shape
        pad = rows * length - (prefill.end - prefill.start)
        pad_embed = self.code.embed(torch.tensor([[self.pad_id]]))[0, 0]
        flat = torch.cat([pad_embed.expand(pad, -1),
                          embeds[prefill.start:prefill.end]])
        if prefill.end == prefill.tokens.numel():
            self.kept = None
        return dataclasses.replace(
            chunks, inputs_embeds=flat.view(rows, length, -1).contiguous())

    @current_platform.inference_mode()
    def _embeds(self, prefill: ImagePrefill,
                tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt's embeddings with its images, then those of the
        outputs a recomputed sequence holds, as text (a generated token
        that is a placeholder's id is a token like any other); kept for
        the same sequence's next chunk, which starts where the last
        ended."""
        tokens, prompt_len = prefill.tokens, prefill.prompt_len
        if self.kept is not None:
            # The same sequence's next chunk: another request (or this
            # one recomputed) starts its prefill at 0, even with the same
            # tokens.
            seen = self.kept[0]
            if (prefill.start > 0 and seen.end == prefill.start
                    and seen.prompt_len == prompt_len
                    and torch.equal(seen.tokens, tokens)):
                self.kept = (prefill, self.kept[1])
                return self.kept[1]
        embeds = self.code.prompt_embeds(tokens[:prompt_len],
                                         self.kwargs(tensors))
        if tokens.numel() > prompt_len:
            outputs = tokens[prompt_len:].unsqueeze(0)
            embeds = torch.cat([embeds, self.code.embed(outputs)[0]])
        self.kept = (prefill, embeds)
        return embeds


def static_prefill(metas) -> dict:
    """The step input's fields of a static batch's prefill (driver):
    ``prefill_image_rows``, ``[K, 2]`` (the row and prompt length of each
    request with images), and ``prefill_image_tensors``, their tensors
    under ``"{row}:{path}"``; none when no request has images."""
    rows, flat = [], {}
    for row, meta in enumerate(metas):
        if not has_images(meta):
            continue
        (data, ) = meta.seq_data.values()
        rows.append((row, data.get_prompt_len()))
        for path, tensor in ImageEmbeds.tensors(
                meta.multi_modal_data).items():
            flat[f"{row}:{path}"] = tensor
    if not rows:
        return {}
    return dict(prefill_image_rows=torch.tensor(rows, dtype=torch.long),
                prefill_image_tensors=flat)


@current_platform.inference_mode()
def static_embeds(code, input_ids: torch.Tensor, rows: torch.Tensor,
                  flat: dict[str, torch.Tensor]) -> torch.Tensor:
    """A static prefill's embeddings, ``[B, L, hidden]`` (every rank):
    each row's ids', and in a row with images (its prompt the last
    ``n`` positions, left-padded) its prompt's with the images merged."""
    embeds = code.embed(input_ids)
    length = input_ids.shape[1]
    for row, n in rows.tolist():
        prefix = f"{row}:"
        mine = {path[len(prefix):]: tensor
                for path, tensor in flat.items() if path.startswith(prefix)}
        embeds[row, length - n:] = code.prompt_embeds(
            input_ids[row, length - n:], ImageEmbeds.kwargs(mine))
    return embeds
