"""The arithmetic and workload of the offline benchmarks
(benchmarks/_common.py): what the printed tables are computed from."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _common  # noqa: E402


def test_prompts_are_fixed_windows_of_exactly_p_tokens():
    ids = list(range(100))
    rows = _common.build_prompts(ids, batch=3, prompt_len=5, stride=13)
    assert rows == [[0, 1, 2, 3, 4], [13, 14, 15, 16, 17],
                    [26, 27, 28, 29, 30]]
    with pytest.raises(ValueError, match="need 105"):
        _common.build_prompts(ids, batch=8, prompt_len=14, stride=13)


def test_benchmark_text_holds_the_default_workload():
    words = _common.TEXT.read_text().split()
    # 16 rows of 64 tokens at stride 13 need 259 tokens; a word is at
    # least one token.
    assert len(words) >= (16 - 1) * _common.STRIDE + 64


def test_summary_medians_and_rates():
    t = _common.Timings(batch=4, new_tokens=11)
    for ttft, total in [(0.5, 2.5), (0.4, 2.4), (0.9, 4.9)]:
        t.runs.append(dict(ttft=ttft, total=total, compiles=0))
    s = t.summary()
    # decode: 4 rows * 10 tokens in (total - ttft) = 2.0, 2.0, 4.0 s
    assert s["decode_tok_s"] == pytest.approx(20.0)
    assert s["step_s"] == pytest.approx(0.2)
    assert s["ttft_s"] == pytest.approx(0.5)
    assert s["total_s"] == pytest.approx(2.5)
    assert s["tok_s"] == pytest.approx(44 / 2.5)
    assert s["compiles"] == 0
    t.runs.append(dict(ttft=0.5, total=2.5, compiles=2))
    assert t.summary()["compiles"] == 2


def test_leading_matches_and_table():
    assert _common.leading_matches([1, 2, 3], [1, 2, 4]) == 2
    assert _common.leading_matches([1, 2], [1, 2]) == 2
    assert _common.leading_matches([5], [1]) == 0
    text = _common.table(["engine", "B"], [["hf", 1], ["spyre", 16]])
    assert text.splitlines() == ["engine   B", "------  --",
                                 "hf       1", "spyre   16"]


def test_spyre_env_one_shape_per_batch_size():
    env = _common.spyre_env("inductor", [(16, 4, 1), (64, 4, 8)])
    assert env == {
        "VLLM_SPYRE_DYNAMO_BACKEND": "inductor",
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,64",
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": "4,4",
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": "1,8",
    }
