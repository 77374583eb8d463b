"""docs/request-flow.md stays true: every ``file.py:Name`` it cites names
a file of the project, of vLLM or of FMS that defines ``Name``, and every
``Class.attribute`` of one of the project's classes names an attribute the
class (or a base class of the project) defines."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

from spyre_support.paths import REPO

DOC = REPO / "docs" / "request-flow.md"
QUALIFIED = re.compile(r"^([\w/]+\.py):(\w+)(?:\.(\w+))?")
DOTTED = re.compile(r"^([A-Z]\w*)\.(\w+)$")


def roots() -> list[Path]:
    import fms
    import vllm
    installed = Path(vllm.__file__).parent
    return [REPO / "vllm", installed, Path(fms.__file__).parent.parent]


def resolve(path: str) -> list[Path]:
    """The files the citation can mean: a path under the project's
    ``vllm/``, the installed vLLM, or site-packages (``fms/...``); a
    shortened path (``models/spyre_families.py``, ``granite.py`` after
    ``fms/models/llama.py``) means the files of the project, vLLM or FMS
    whose paths end with it."""
    for root in roots():
        if (root / path).is_file():
            return [root / path]
    import fms
    found = []
    for root in (REPO / "vllm", Path(fms.__file__).parent, roots()[1]):
        found += [p for p in root.rglob(Path(path).name)
                  if p.as_posix().endswith("/" + path)]
    return found


@lru_cache(maxsize=None)
def definitions(path: Path) -> dict[str, set[str] | None]:
    """Top-level names of a file: a class maps to the names its body
    defines, the attributes its methods set, and its bases' names (as
    ``^Base``); anything else to None."""
    tree = ast.parse(path.read_text())
    names: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = {f"^{ast.unparse(b).split('.')[-1].split('[')[0]}"
                       for b in node.bases}
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef,
                                     ast.ClassDef)):
                    members.add(item.name)
                    # and the attributes its methods set on ``self``
                    members.update(
                        t.attr for t in ast.walk(item)
                        if isinstance(t, ast.Attribute)
                        and isinstance(t.ctx, ast.Store)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self")
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets
                                   if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and \
                        isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            names[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            names.update((t.id, None) for t in node.targets
                         if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and \
                isinstance(node.target, ast.Name):
            names[node.target.id] = None
    return names


@lru_cache(maxsize=None)
def project_classes() -> dict[str, set[str]]:
    """Every class of the project's own files: name -> members."""
    classes: dict[str, set[str]] = {}
    for path in (REPO / "vllm").rglob("spyre*.py"):
        for name, members in definitions(path).items():
            if members is not None:
                classes[name] = members
    return classes


def defines(cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
    """Whether a project class or one of its project bases defines
    ``attr``; True where a base is not the project's (it cannot be read
    here)."""
    members = project_classes()[cls]
    if attr in members:
        return True
    bases = [m[1:] for m in members if m.startswith("^")]
    for base in bases:
        if base in seen:
            continue
        if base not in project_classes():
            if base not in ("object", "Generic", "Protocol", "Module"):
                return True
            continue
        if defines(base, attr, seen | {cls}):
            return True
    return False


def cited() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def test_the_doc_cites_files_and_classes():
    refs = cited()
    assert sum(bool(QUALIFIED.match(r)) for r in refs) > 100
    assert sum(bool(DOTTED.match(r)) for r in refs) > 50


@pytest.mark.parametrize("ref", sorted({r for r in cited()
                                        if QUALIFIED.match(r)}))
def test_every_cited_file_defines_the_name(ref):
    path, name, attr = QUALIFIED.match(ref).groups()
    files = [f for f in resolve(path) if name in definitions(f)]
    assert files, f"{ref}: no file {path} defines {name}"
    found = files[0]
    if attr and name in project_classes() and \
            found.is_relative_to(REPO / "vllm"):
        assert defines(name, attr), f"{ref}: {name} has no {attr}"


@pytest.mark.parametrize("ref", sorted({r for r in cited()
                                        if DOTTED.match(r)
                                        and (DOTTED.match(r).group(1)
                                             in project_classes()
                                             or r.startswith("Spyre"))}))
def test_every_project_class_attribute_exists(ref):
    """A ``Spyre...`` class is the project's: it must exist."""
    cls, attr = DOTTED.match(ref).groups()
    assert cls in project_classes(), f"{ref}: no class {cls}"
    assert defines(cls, attr), f"{ref}: {cls} has no {attr}"
