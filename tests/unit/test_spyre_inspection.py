"""vllm/model_executor/models/spyre_inspection.py: on Spyre, vLLM's
registry inspects a model class in-process, with the same result as its
subprocess."""
from __future__ import annotations

import subprocess

import pytest

from vllm.model_executor.models import registry
from vllm.model_executor.models import spyre_inspection


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(registry, "_run_in_subprocess",
                        registry._run_in_subprocess)
    spyre_inspection.install()
    spyre_inspection.install()  # idempotent
    return registry._run_in_subprocess


def test_install_on_spyre_runs_the_inspection_here(installed):
    assert installed is spyre_inspection.run_here


def test_inspection_result_without_a_subprocess(installed, monkeypatch):

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess was started")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    lazy = registry._LazyRegisteredModel("vllm.model_executor.models.llama",
                                         "LlamaForCausalLM")
    info = lazy.inspect_model_cls()
    assert info == registry._ModelInfo.from_model_cls(lazy.load_model_cls())
    assert info.is_text_generation_model and not info.is_pooling_model


def test_nothing_changes_off_spyre(monkeypatch):
    original = registry._run_in_subprocess
    monkeypatch.setattr(registry, "_run_in_subprocess", original)
    monkeypatch.setattr("vllm.config.spyre.is_spyre", lambda: False)
    spyre_inspection.install()
    assert registry._run_in_subprocess is original
