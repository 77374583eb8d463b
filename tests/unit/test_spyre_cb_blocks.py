"""Unit tests of continuous batching's refusals
(vllm/core/spyre_cb_blocks.py): the model length and the block pool,
for one sequence and for parallel samples."""

from vllm.core.spyre_cb_blocks import (parallel_samples_reason,
                                       rejection_reason)


# --------------------------------------------------------- rejection_reason
def test_rejection_reason_model_len_boundary():
    # 60 + 4 == max_model_len: fits; one more token does not.
    assert rejection_reason(60, 4, 64, 64, usable_blocks=10) is None
    assert rejection_reason(1, 63, 64, 64, usable_blocks=10) is None
    msg = rejection_reason(61, 4, 64, 64, usable_blocks=10)
    assert msg is not None
    assert "needs 65 tokens" in msg
    assert "prompt length 61 + max_tokens 4" in msg
    assert "max_model_len=64" in msg
    assert "--max-model-len" in msg
    assert rejection_reason(60, 5, 64, 64, usable_blocks=10) is not None


def test_rejection_reason_block_boundary():
    # 128 tokens need exactly the 2 usable blocks; 129 need 3.
    assert rejection_reason(100, 28, 1024, 64, usable_blocks=2) is None
    msg = rejection_reason(100, 29, 1024, 64, usable_blocks=2)
    assert msg is not None
    assert "needs 3 key/value blocks of 64 tokens" in msg
    assert "prompt length 100 + max_tokens 29" in msg
    assert "the 2 usable blocks" in msg
    assert "--num-gpu-blocks-override" in msg
    # A short request needs one block, however small the pool.
    assert rejection_reason(1, 1, 1024, 64, usable_blocks=1) is None
    assert rejection_reason(1, 1, 1024, 64, usable_blocks=0) is not None


def test_rejection_reason_model_len_is_checked_first():
    msg = rejection_reason(200, 100, 256, 64, usable_blocks=1)
    assert "max_model_len=256" in msg
    assert "key/value blocks" not in msg



def test_parallel_samples_reason_max_num_seqs():
    assert parallel_samples_reason(4, 10, 10, 4, 64, 100) is None
    msg = parallel_samples_reason(5, 10, 10, 4, 64, 100)
    assert "n=5" in msg and "--max-num-seqs=4" in msg


def test_parallel_samples_reason_blocks_of_all_samples():
    # 3 samples of 100 + 28 tokens: 2 blocks each, 6 in all.
    assert parallel_samples_reason(3, 100, 28, 8, 64, 6) is None
    msg = parallel_samples_reason(3, 100, 29, 8, 64, 8)
    assert msg is not None
    assert "n=3" in msg
    assert "need 9 key/value blocks of 64 tokens" in msg
    assert "the 8 usable blocks" in msg
