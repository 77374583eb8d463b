"""Every runner's step input survives the driver's broadcast: flattened by
``as_broadcastable_tensor_dict`` into what vLLM's ``broadcast_tensor_dict``
sends, rebuilt by ``from_broadcasted_tensor_dict`` on another rank, equal
field by field; the driver-only metadata and the absent parts stay out."""
from __future__ import annotations

import dataclasses

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.model_executor.layers.spyre_mamba import StateRows
from vllm.worker.spyre_cb_model_runner import SpyreCBModelInput
from vllm.worker.spyre_pooling_inputs import EncoderInputs
from vllm.worker.spyre_pooling_model_runner import SpyrePoolingModelInput
from vllm.worker.spyre_static_inputs import StepInputs
from vllm.worker.spyre_static_model_runner import SpyreStaticModelInput


def ints(*shape, start=0):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(start, start + n).reshape(shape)


def same(a, b) -> bool:
    """Equal values, tensors compared element by element."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(
            same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def round_trip(step):
    sent = step.as_broadcastable_tensor_dict()
    # Only plain values and tensors travel (vLLM's broadcast splits them).
    assert all(isinstance(v, (torch.Tensor, bool, int))
               for v in sent.values()), sent
    return sent, type(step).from_broadcasted_tensor_dict(sent)


def paged(start):
    return PagedInputs(ints(2, 1, start=start), ints(2, 1, start=start + 1),
                       ints(2, 1, start=start + 2), ints(2, 4, start=start),
                       ints(2, 1, start=start + 3))


def test_static_step():
    step = SpyreStaticModelInput(
        is_prompt=True,
        inputs=StepInputs(ints(2, 3), ints(2, 3, start=5),
                          torch.ones(2, 3, 3, dtype=torch.bool), ints(3), 7),
        live_rows=torch.tensor([1, 0]),
        sampling_metadata=object(),
        logprob_rows=ints(1, 3))
    sent, got = round_trip(step)
    assert "sampling_metadata" not in sent
    assert sent["inputs.cache_len"] == 7
    assert got.sampling_metadata is None
    assert same(dataclasses.replace(step, sampling_metadata=None), got)


def test_static_step_without_prompt_logprobs():
    step = SpyreStaticModelInput(
        is_prompt=False,
        inputs=StepInputs(ints(1, 1), ints(1, 1), torch.ones(1, 1, 4,
                                                             dtype=bool),
                          ints(1), 4),
        live_rows=torch.tensor([0]))
    sent, got = round_trip(step)
    assert "logprob_rows" not in sent
    assert got.logprob_rows is None and same(step, got)


def test_cb_step_with_both_parts_and_states():
    step = SpyreCBModelInput(
        prefill=paged(0), decode=paged(10), num_live=2,
        sample_prefill=False, sampling_metadata=object(),
        logprob_ids=ints(1, 5), logprob_k=3,
        prefill_states=StateRows(ints(2), torch.tensor([True, False]),
                                 torch.ones(2, 1, dtype=torch.bool)),
        decode_states=None)
    sent, got = round_trip(step)
    assert not any(k.startswith("decode_states") for k in sent)
    assert got.decode_states is None
    assert same(dataclasses.replace(step, sampling_metadata=None), got)


def test_cb_decode_only_step():
    step = SpyreCBModelInput(prefill=None, decode=paged(3), num_live=2)
    sent, got = round_trip(step)
    assert not any(k.startswith("prefill.") for k in sent)
    assert got.prefill is None and same(step, got)


def test_pooling_step_of_two_passes():
    passes = tuple(
        EncoderInputs(ints(1, 4, start=i), ints(1, 4), ints(1, 4),
                      torch.ones(1, 4, 4, dtype=torch.bool), ints(1, 4),
                      ints(3, start=i)) for i in range(2))
    step = SpyrePoolingModelInput(passes=passes, pooling_metadata=object())
    sent, got = round_trip(step)
    assert sent["passes"] == 2 and "pooling_metadata" not in sent
    assert same(dataclasses.replace(step, pooling_metadata=None), got)
