"""Shared fixtures: the installed-code check, tiny random Llama checkpoints,
the default model and Hugging Face references.  Helpers are imported from
``spyre_support``, never from here."""
from __future__ import annotations

import filecmp
import os
import sysconfig
from pathlib import Path

import pytest

from spyre_support.paths import REPO, SMOLLM2_DIR
from spyre_support.reference import HFReference
from spyre_support.tiny_models import build_tiny_llama

os.environ.setdefault("VLLM_USE_V1", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    """Refuses to test a stale install: every module under vllm/ of the
    working tree must be the one installed in site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    stale = [
        str(src.relative_to(REPO)) for pattern in ("*.py", "*.cpp")
        for src in (REPO / "vllm").rglob(pattern)
        if not (site / src.relative_to(REPO)).exists()
        or not filecmp.cmp(src, site / src.relative_to(REPO), shallow=False)
    ]
    import spyre_support
    if Path(spyre_support.__file__).resolve().parent != (
            REPO / "support" / "spyre_support"):
        stale.append(f"spyre_support (installed from "
                     f"{Path(spyre_support.__file__).parent})")
    if stale:
        pytest.exit(
            "The installed Spyre modules differ from the working tree "
            f"({', '.join(stale)}); run the tests with `make test`, which "
            "re-installs the project first.", returncode=3)


# ---- tiny random checkpoints ---------------------------------------------

@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_2k(tmp_path_factory) -> Path:
    """The tiny Llama with 2,048 positions, for prompts beyond 1,024."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"),
                            positions=2048)


@pytest.fixture(scope="session")
def tiny_llama_3kv(tmp_path_factory) -> Path:
    """The tiny Llama with 6/3 heads: splits over 3 ranks."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-3kv"),
                            heads=6, kv_heads=3)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not (SMOLLM2_DIR / ".provisioned").exists():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make test`, which "
                    "provisions it")
    return SMOLLM2_DIR


# ---- references ------------------------------------------------------------

@pytest.fixture(scope="session")
def hf_tiny(tiny_llama) -> HFReference:
    """transformers' greedy reference of the tiny Llama."""
    return HFReference(tiny_llama)
