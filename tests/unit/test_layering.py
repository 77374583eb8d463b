"""The project's modules keep their layers: the import contracts of
``pyproject.toml`` (import-linter) hold on the installed package, every
module of this repository is named in them, and no import cycle joins the
project's modules.  A change that imports upwards (a model importing a
runner, the settings importing the platform), makes a scheduler import a
worker, or adds a module outside the contract fails here."""
import re
import tomllib
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"


def project_modules() -> list[str]:
    """Every module this repository adds under ``vllm``."""
    modules = []
    for path in sorted((REPO / "vllm").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    return modules


def contract_layers() -> list[list[str]]:
    """The layers of the layering contract, top first, as module lists."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (layers, ) = [c["layers"] for c in config["contracts"]
                  if c["type"] == "layers"]
    return [re.split(r"\s*[|:]\s*", layer.strip()) for layer in layers]


def layer_of(module: str, layers: list[list[str]]) -> int:
    """Index of the layer holding ``module`` (itself or a package above
    it); -1 if none does."""
    for i, layer in enumerate(layers):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return -1


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("vllm", "vllm.spyre_kernels", cache_dir=None)


def test_import_contracts_hold(capsys):
    code = lint_imports(config_filename=str(PYPROJECT), no_cache=True,
                        no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 kept, 0 broken" in out


def test_every_project_module_is_in_a_layer():
    layers = contract_layers()
    missing = [m for m in project_modules() if layer_of(m, layers) < 0]
    assert not missing, (
        f"modules outside the layering contract in pyproject.toml: "
        f"{missing}")


def test_every_layered_module_exists():
    ours = set(project_modules())
    named = [m for layer in contract_layers() for m in layer]
    assert [m for m in named if m not in ours] == []


def test_no_direct_import_goes_up(graph):
    """The same rule as the contract, read straight off the import graph:
    each project module imports only from layers below it (or its own)."""
    layers = contract_layers()
    ours = set(project_modules())
    upward = []
    for module in ours:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in ours and \
                    layer_of(imported, layers) < layer_of(module, layers):
                upward.append(f"{module} -> {imported}")
    assert upward == []


def test_no_cycle_among_project_modules(graph):
    ours = set(project_modules())
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m)
                  if i in ours)
        for m in ours
    }
    assert find_cycle(edges) is None


def find_cycle(edges: dict[str, list[str]]):
    """A cycle of ``edges`` (module -> modules it imports) as a list of
    modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == [
        "a", "b", "c", "a"
    ]
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None


def lint_one(tmp_path, contract: str) -> int:
    """``lint-imports``' exit code for one contract (TOML lines)."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_package = "vllm"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "probe"\n' +
                      contract)
    return lint_imports(config_filename=str(config), no_cache=True,
                        no_logo=True)


def test_the_contract_sees_the_project_imports(tmp_path):
    """A contract with the worker below the model code it imports is
    reported broken: the linter reads the installed project's imports."""
    def layers(top: str, bottom: str) -> int:
        return lint_one(tmp_path, 'type = "layers"\n'
                        f'layers = ["{top}", "{bottom}"]\n')

    assert layers("vllm.model_executor.models.spyre_causal_lm",
                  "vllm.worker.spyre_static_model_runner") != 0
    assert layers("vllm.worker.spyre_static_model_runner",
                  "vllm.model_executor.models.spyre_causal_lm") == 0


def test_the_contract_refuses_a_scheduler_importing_a_worker(tmp_path):
    """The forbidden contract catches an import that the layers allow (a
    scheduler sits above the workers): with the CB scheduler's own import
    of ``spyre_cb_blocks`` forbidden, the linter reports it."""
    def forbid(module: str) -> int:
        return lint_one(tmp_path, 'type = "forbidden"\n'
                        'source_modules = ["vllm.core.spyre_cb_scheduler"]\n'
                        f'forbidden_modules = ["{module}"]\n')

    assert forbid("vllm.core.spyre_cb_blocks") != 0
    # The same contract over a module it does not import is kept: the
    # failure above is the import, not the configuration.
    assert forbid("vllm.worker.spyre_cb_inputs") == 0
