"""The graph cache's code digest reads an explicit list of files
(``spyre_graph_cache.GRAPH_CODE``): every listed file must exist, so that
moving or renaming one fails here instead of silently dropping it from the
digest; and every file of the model code and kernel folders must be listed
(or named in ``NOT_GRAPH_CODE``), so that a new model or kernel file
cannot be forgotten."""
from pathlib import Path

from vllm.compilation import spyre_graph_cache as gc

REPO = Path(__file__).resolve().parents[2]
VLLM = REPO / "vllm"
#: Folders whose Spyre files are model code, kernels or compile set-up.
CODE_FOLDERS = ("attention", "compilation", "lora", "model_executor",
                "spyre_kernels")
SUFFIXES = (".py", ".cpp", ".h")


def test_every_listed_file_exists():
    missing = [rel for rel in gc.GRAPH_CODE if not (VLLM / rel).is_file()]
    assert missing == [], (
        f"GRAPH_CODE lists files that are not in vllm/: {missing}")


def test_no_file_is_listed_twice():
    listed = gc.GRAPH_CODE + gc.NOT_GRAPH_CODE
    assert len(set(listed)) == len(listed)


def test_every_model_code_file_is_listed():
    listed = set(gc.GRAPH_CODE) | set(gc.NOT_GRAPH_CODE)
    found = sorted(
        p.relative_to(VLLM).as_posix() for folder in CODE_FOLDERS
        for p in (VLLM / folder).rglob("*")
        if p.suffix in SUFFIXES and "spyre" in p.relative_to(VLLM).as_posix())
    unlisted = [rel for rel in found if rel not in listed]
    assert unlisted == [], (
        "files of the model code folders in neither GRAPH_CODE nor "
        f"NOT_GRAPH_CODE: {unlisted}")


def test_the_digest_follows_the_listed_files(monkeypatch, tmp_path):
    """The digest reads the listed files from the installed package: a
    change to the list changes it."""
    first = gc.code_identity()
    assert len(first) == 16 and first == gc.code_identity()
    monkeypatch.setattr(gc, "GRAPH_CODE", gc.GRAPH_CODE[1:])
    assert gc.code_identity() != first
