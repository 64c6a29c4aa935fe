"""experiments/ holds scripts that run at this commit on public names (issue 38): every ``experiments/**/*.py``,
parsed (not run), imports no ``_private`` name from lynn_kernels, lynn_model or lynn_cli, and every lynn name it
imports, or reaches as an attribute of an imported lynn module, exists here; a module with ``__all__`` must list the
name (or have it as a submodule). Each script says what it asks in a docstring, and experiments/README.md names it."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
PACKAGES = ("lynn_kernels", "lynn_model", "lynn_cli")
SCRIPTS = sorted(EXPERIMENTS.rglob("*.py"))


def ours(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PACKAGES


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def public_member(module: types.ModuleType, name: str, where: str) -> object:
    """``module.name``, which must be public: not ``_private``, present, and in ``__all__`` when the module has one
    (a submodule of a package counts as public)."""
    assert not private(name), f"{where}: {module.__name__}.{name} is private"
    try:
        value = getattr(module, name)
    except AttributeError:
        try:
            value = importlib.import_module(f"{module.__name__}.{name}")
        except ModuleNotFoundError:
            raise AssertionError(f"{where}: {module.__name__} has no {name} at this commit") from None
    names = getattr(module, "__all__", None)
    if names is not None and not isinstance(value, types.ModuleType):
        assert name in names, f"{where}: {module.__name__}.{name} is not in {module.__name__}.__all__"
    return value


def import_ours(module: str, where: str) -> types.ModuleType:
    bad = [part for part in module.split(".") if private(part)]
    assert not bad, f"{where}: imports the private module {module}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise AssertionError(f"{where}: {module} does not exist at this commit ({err})") from None


def attribute_chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None when the chain does not start at a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def check_script(path: Path, root: Path = ROOT) -> int:
    """Assert the rules on one script; return how many lynn names it uses."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    modules: dict[str, types.ModuleType] = {}           # a name bound to one of our modules
    used = 0
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    mod = import_ours(alias.name, where)
                    bound = alias.asname or alias.name.split(".")[0]
                    modules[bound] = mod if alias.asname else importlib.import_module(bound)
                    used += 1
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and ours(node.module):
            mod = import_ours(node.module, where)
            for alias in node.names:
                value = public_member(mod, alias.name, where)
                if isinstance(value, types.ModuleType):
                    modules[alias.asname or alias.name] = value
                used += 1
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):                         # module attributes: lynn_model.preset, runtime.KERNELS
        if isinstance(node, ast.Attribute) and id(node) not in inner:     # each chain once, from its outer end
            chain = attribute_chain(node)
            if chain is None or chain[0] not in modules:
                continue
            value = modules[chain[0]]
            for attr in chain[1]:
                if not isinstance(value, types.ModuleType):
                    break
                value = public_member(value, attr, f"{rel}:{node.lineno}")
                used += 1
    return used


def test_there_are_experiments():
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(EXPERIMENTS).as_posix())
def test_script_uses_public_names_that_exist(path):
    check_script(path)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(EXPERIMENTS).as_posix())
def test_script_says_what_it_asks_and_is_listed(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name}: no docstring (the question, how to run it)"
    assert path.relative_to(EXPERIMENTS).as_posix() in (EXPERIMENTS / "README.md").read_text(), \
        f"experiments/README.md does not name {path.relative_to(EXPERIMENTS).as_posix()}"


def test_the_checker_catches_private_and_missing_names(tmp_path):
    cases = {"from lynn_kernels.runtime import _routes": "private",
             "from lynn_kernels._nope import x": "private module",
             "from lynn_kernels import no_such_name_here": "has no",
             "import lynn_kernels\nlynn_kernels.runtime._routes": "private",
             "from lynn_kernels import lab\nlab.no_such_thing()": "has no",
             "from lynn_kernels.bench import annotations": "not in lynn_kernels.bench.__all__"}
    for i, (src, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.py"
        bad.write_text(src + "\n")
        with pytest.raises(AssertionError, match=message):
            check_script(bad, tmp_path)
    good = tmp_path / "good.py"
    good.write_text("import lynn_model\nfrom lynn_kernels import lab, runtime\n"
                    "lab.variant\nruntime.KERNELS.items()\nlynn_model.preset('tiny-qwen3.5-moe').name\n")
    assert check_script(good, tmp_path) >= 5
