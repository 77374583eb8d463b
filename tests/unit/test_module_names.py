"""No module of ours binds one top-level name twice: a function or class
that takes the name of something the module imported (or defined above it)
replaces it for every caller in the module, and a wrapper named after the
helper it wraps calls itself until the recursion limit.  Covers tests/,
benchmarks/, the support package and the project's modules under vllm/."""
import ast
from pathlib import Path

import pytest

from spyre_support.paths import REPO

TREES = ("tests", "benchmarks", "support", "vllm")


def our_files(tree: str) -> list[Path]:
    files = sorted((REPO / tree).rglob("*.py"))
    if tree == "vllm":  # vLLM's own modules are not ours to check
        files = [p for p in files if "spyre" in str(p.relative_to(REPO))]
    return files


def rebound_names(source: str) -> list[str]:
    """Top-level names a ``def`` or ``class`` binds after an import or an
    earlier definition bound them.  The branches of an ``if`` and a
    ``try``'s body and handlers are alternatives: each starts from what
    was bound before them."""
    rebound: list[str] = []

    def visit(body, bound: set[str]) -> set[str]:
        bound = set(bound)
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0]
                          for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                   ast.ClassDef)):
                if node.name in bound:
                    rebound.append(f"{node.name} (line {node.lineno})")
                bound.add(node.name)
            elif isinstance(node, ast.If):
                bound = visit(node.body, bound) | visit(node.orelse, bound)
            elif isinstance(node, ast.Try):
                branches = [visit(node.body, bound)]
                branches += [visit(h.body, bound) for h in node.handlers]
                bound = set().union(*branches)
                bound = visit(node.orelse + node.finalbody, bound)
        return bound

    visit(ast.parse(source).body, set())
    return rebound


def test_a_wrapper_named_after_its_import_is_found():
    source = ("from helpers import cb_env\n\n"
              "def cb_env(backend):\n    return cb_env(backend)\n")
    assert rebound_names(source) == ["cb_env (line 3)"]


def test_alternative_definitions_are_not_rebindings():
    source = ("try:\n    from fast import run\nexcept ImportError:\n"
              "    def run():\n        pass\n"
              "if FLAG:\n    def go():\n        pass\nelse:\n"
              "    def go():\n        pass\n")
    assert rebound_names(source) == []


@pytest.mark.parametrize("tree", TREES)
def test_no_top_level_name_is_bound_twice(tree):
    found = {str(p.relative_to(REPO)): rebound_names(p.read_text())
             for p in our_files(tree)}
    assert {k: v for k, v in found.items() if v} == {}
