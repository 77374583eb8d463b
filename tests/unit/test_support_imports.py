"""Tests and benchmarks share code only through the support package
(support/spyre_support): no file of tests/, benchmarks/ or the package
inserts into ``sys.path``; no test imports a benchmark's private module
(``_drivers``, ``_engines``, ...) and no benchmark imports a test module;
the package imports neither."""
import ast
from pathlib import Path

import pytest

from spyre_support.paths import REPO

TREES = ("tests", "benchmarks", "support")


def python_files(tree: str) -> list[Path]:
    return sorted((REPO / tree).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
    return names


def inserts_into_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in ("insert",
                                                              "append")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "path"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "sys"):
            return True
    return False


#: Runs a script as ``python script.py`` does, its folder first on
#: ``sys.path`` (in a process of its own, never the caller's).
SCRIPT_RUNNER = "support/spyre_support/preloaded.py"


@pytest.mark.parametrize("tree", TREES)
def test_no_sys_path_insert(tree):
    assert [str(p.relative_to(REPO)) for p in python_files(tree)
            if inserts_into_sys_path(p)
            and str(p.relative_to(REPO)) != SCRIPT_RUNNER] == []


def test_tests_import_no_private_benchmark_module():
    private = {p.stem for p in python_files("benchmarks")
               if p.stem.startswith("_")}
    found = {str(p.relative_to(REPO)): sorted(imported_modules(p) & private)
             for p in python_files("tests")}
    assert {k: v for k, v in found.items() if v} == {}


def test_benchmarks_and_the_package_import_no_test_module():
    tests = {p.stem for p in python_files("tests")} | {"conftest"}
    found = {str(p.relative_to(REPO)): sorted(imported_modules(p) & tests)
             for tree in ("benchmarks", "support")
             for p in python_files(tree)}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_package_imports_no_benchmark():
    scripts = {p.stem for p in python_files("benchmarks")}
    found = {str(p.relative_to(REPO)): sorted(imported_modules(p) & scripts)
             for p in python_files("support")}
    assert {k: v for k, v in found.items() if v} == {}
