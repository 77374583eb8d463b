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


def pytest_report_header(config):
    """The machine, in the run's header: the suite's time depends on it
    (docs/testing.md, "Time")."""
    from spyre_support.bench import cpu_summary
    return f"machine: {cpu_summary()}"


# The files that take longest, longest first.  `scripts/run_tests.sh`
# hands whole files to its workers in collection order: a long file handed
# out last would leave one worker running it alone while the other has
# nothing left.  Every other end-to-end file follows in its own order, then
# the unit tests, which fill the gaps.  Order only: a file missing here, or
# a name left after a rename, changes when a file runs, not whether.
LONGEST_FIRST = (
    "test_model_impl.py", "test_model_families.py", "test_graph_cache.py",
    "test_quantization.py", "test_external_launcher.py", "test_benchmarks.py",
    "test_embeddings.py", "test_hybrid.py", "test_tensor_parallel.py",
    "test_continuous_batching.py", "test_examples.py", "test_lm_eval.py",
    "test_bf16.py", "test_server_robustness.py",
)


# Files handed to one worker as a single unit, one after the other: those
# whose tests run on the same shared engine (``shared_llm``), and those
# that start a local Ray cluster (two clusters started at once on one
# machine broke each other: a node "crashed" and Ray ended the worker).
SAME_WORKER = {
    "test_sampling.py": "request_llm",
    "test_structured_output.py": "request_llm",
    "test_tensor_parallel.py": "local_ray_cluster",
    "test_continuous_batching.py": "local_ray_cluster",
}


def pytest_xdist_make_scheduler(config, log):
    """xdist's whole-file scheduling, with the files of ``SAME_WORKER``
    grouped; other distribution modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(Path(scope).name, scope)

    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config, items):
    """Items sorted by their file's place: ``LONGEST_FIRST``, the other
    end-to-end files, then the unit tests (the sort is stable, so each
    file keeps its own order)."""
    def place(item) -> int:
        path = Path(str(item.fspath))
        if path.name in LONGEST_FIRST:
            return LONGEST_FIRST.index(path.name)
        return len(LONGEST_FIRST) + (path.parent.name != "e2e")
    items.sort(key=place)


#: The variables that configure an engine and the processes it starts:
#: vLLM's and the Spyre settings, the ranks' rendezvous and numbering,
#: thread counts, the devices, Hugging Face's offline switches.  Every
#: later engine and server of the worker starts under them.  Others belong
#: to the libraries that set them on first use (Ray, torch's inductor,
#: tokenizers), in whichever test that happens to be; they are left alone.
ENVIRON_WATCHED = ("VLLM_", "SPYRE_", "MASTER_ADDR", "MASTER_PORT", "RANK",
                   "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "HF_",
                   "TRANSFORMERS_")
#: Watched variables a test may leave changed: the platform's
#: usage-statistics switch, set on purpose for the life of the process
#: (``spyre.usage_stats_unset``).
ENVIRON_OWNED_ELSEWHERE = ("VLLM_NO_USAGE_STATS", )


def _environ() -> dict[str, str]:
    """The ``ENVIRON_WATCHED`` part of ``os.environ``, but
    ``ENVIRON_OWNED_ELSEWHERE``."""
    return {name: value for name, value in os.environ.items()
            if name.startswith(ENVIRON_WATCHED)
            and not name.startswith(ENVIRON_OWNED_ELSEWHERE)}


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """Each test leaves ``os.environ`` as it found it: an engine built in
    this process must not leave its settings (rank variables, a start
    method) to the servers and engines of later tests, which start under
    this environment.  A test that changed a watched variable
    (``ENVIRON_WATCHED``) fails, naming it, and it is put back."""
    before = _environ()
    yield
    after = _environ()
    if after != before:
        changed = sorted(name for name in before.keys() | after.keys()
                         if before.get(name) != after.get(name))
        for name in changed:
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        pytest.fail("the test left os.environ changed: "
                    + ", ".join(f"{name}={after.get(name)!r}"
                                for name in changed), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def shared_engine_released():
    """The session's shared engine (``shared_llm``) is torn down at its
    end, before the worker exits."""
    yield
    from spyre_support.engines import drop_shared
    drop_shared()


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
