"""What the tests of continuous batching's inputs share
(test_spyre_cb_inputs.py, test_spyre_cb_decode.py): the pad id, a
tensor's rows as lists, and the dtype every input tensor must have."""
import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs

PAD_ID = 0


def rows(t: torch.Tensor) -> list:
    return t.tolist()


def assert_int64(inputs: PagedInputs) -> None:
    for t in (inputs.input_ids, inputs.position_ids, inputs.cache_slots,
              inputs.block_table, inputs.ctx_lens):
        assert t.dtype == torch.int64
