"""Imports point down: kernels (``lynn_kernels``), then the model (``lynn_model``), then the CLI (``lynn_cli``).

Read from the sources (``ast``: nothing is imported or run), every import counted, those inside functions too:

* ``lynn_kernels`` imports neither ``lynn_model`` nor ``lynn_cli``; ``lynn_model`` does not import ``lynn_cli``;
* a kernel family (``lynn_kernels/<family>/``) imports no other family's Triton file (``triton_*.py``): helpers that
  cross families live in ``lynn_kernels/triton_shared.py``; a family's public Python API (its ``__init__``,
  ``spec``, ``packed``, ...) may be imported. The benchmarks (``lynn_kernels/bench/``) are no family: they time
  each family's launchers;
* no module of ``lynn_kernels`` imports a ``_private`` name from a module outside its own family (or package);
* the imports among ``lynn_kernels``' modules form no cycle (but for the few method-time calls of ``LATE_CALLS``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lynn_kernels", "lynn_model", "lynn_cli")
FAMILIES = ("attention", "deltanet", "matmul", "moe", "norm", "nvfp4")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three packages (a package is its ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import in the file, anywhere in it, resolved to absolute
    dotted names; ``from X import y`` where ``X.y`` is a module gives ``(X.y, None, line)``."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]          # the package relative imports start from
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[:len(here) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "lynn_kernels" and len(parts) > 1 and parts[1] in FAMILIES else None


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_the_sources_are_found():
    assert {"lynn_kernels.triton_shared", "lynn_kernels.moe.spec", "lynn_model.bench", "lynn_cli.bench"} <= set(MODULES)
    assert sum(1 for m in MODULES if _family(m)) >= 30


@pytest.mark.parametrize("package,forbidden", [("lynn_kernels", {"lynn_model", "lynn_cli"}),
                                               ("lynn_model", {"lynn_cli"})])
def test_packages_import_only_downward(package, forbidden):
    bad = sorted({f"{_where(name, line)} imports {target}" for name, found in IMPORTS.items()
                  if _top(name) == package for target, _, line in found if _top(target) in forbidden})
    assert not bad, "\n".join(bad)


def test_no_family_imports_another_familys_triton_file():
    bad = sorted({f"{_where(name, line)} imports {target}" for name, found in IMPORTS.items() if _family(name)
                  for target, _, line in found
                  if _family(target) not in (None, _family(name)) and target.split(".")[-1].startswith("triton_")})
    assert not bad, "shared Triton helpers belong in lynn_kernels/triton_shared.py:\n" + "\n".join(bad)


def test_no_private_name_from_outside_the_family():
    def owner(module: str) -> str:                  # a family, or the package a module outside the families lies in
        return _family(module) or module.rsplit(".", 1)[0]

    bad = sorted({f"{_where(name, line)} imports {target}.{imported}" for name, found in IMPORTS.items()
                  if _top(name) == "lynn_kernels" for target, imported, line in found
                  if _top(target) == "lynn_kernels" and imported and imported.startswith("_")
                  and not imported.startswith("__") and target != name and owner(target) != owner(name)})
    assert not bad, "\n".join(bad)


#: Edges left out of the cycle check, each a method of a family's data class calling its family's public op (the op
#: is built on the class, so the call is resolved when the method runs). Listed by hand: a new one fails the test.
LATE_CALLS = {
    ("lynn_kernels.nvfp4.tensor", "lynn_kernels.nvfp4"): "NVFP4Tensor.dequantize calls nvfp4.dequantize",
    ("lynn_kernels.matmul.linear", "lynn_kernels.matmul"): "NVFP4Linear.forward calls matmul.nvfp4_linear",
}


def test_the_late_calls_are_still_there():
    """Each listed edge still exists (drop it from ``LATE_CALLS`` once it is gone)."""
    for module, package in LATE_CALLS:
        assert package in {t for t, _, _ in IMPORTS[module]}, (module, package)


def test_lynn_kernels_imports_form_no_cycle():
    graph = {name: sorted({t for t, _, _ in found if t in MODULES and t != name and (name, t) not in LATE_CALLS})
             for name, found in IMPORTS.items() if _top(name) == "lynn_kernels"}
    state: dict[str, int] = {}                      # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, "import cycles among lynn_kernels' modules:\n" + "\n".join(cycles)
