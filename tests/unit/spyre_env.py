"""Fixtures and environments of Spyre settings for the configuration
tests: whether torch_sendnn (the card's compile backend) seems importable,
whatever machine the tests run on, and warm-up shape variables."""
import pytest

from vllm.compilation import spyre_sendnn


@pytest.fixture
def no_sendnn(monkeypatch):
    """Behave as on a machine without torch_sendnn, wherever tests run."""
    monkeypatch.setattr(spyre_sendnn, "sendnn_available", lambda: False)


@pytest.fixture
def with_sendnn(monkeypatch):
    """Behave as on a machine where torch_sendnn imports."""
    monkeypatch.setattr(spyre_sendnn, "sendnn_available", lambda: True)


def shapes_env(prompt_lens, new_tokens, batch_sizes, **extra):
    env = {
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": prompt_lens,
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": new_tokens,
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": batch_sizes,
    }
    env.update(extra)
    return env
