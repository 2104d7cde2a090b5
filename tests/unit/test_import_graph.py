"""The package's shape: no import cycle anywhere, and `make lint`'s layer contracts catch a break.

The cycle walk counts what Python runs: module-level, function-level and TYPE_CHECKING imports,
and "celery_lease.x:Name" strings (Celery resolves them: Request, Strategy, task_cls). ``from P
import m`` is an edge to P (its ``__init__`` runs) and to P.m. Source only; nothing is imported.
import-linter's contracts (setup.cfg) keep the layers in order; this keeps any two modules, in
one layer or not, from needing each other.
"""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import celery_lease

ROOT = Path(celery_lease.__file__).resolve().parent
SETUP_CFG = ROOT.parent / "setup.cfg"
IMPORT_STRING = re.compile(r"^(celery_lease(?:\.\w+)*):\w+$")
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def edges(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, however and wherever it imports them."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(anchor + ([node.module] if node.module else []))
            targets += [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if m := IMPORT_STRING.match(node.value):
                targets.append(m.group(1))
    out = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles_in(root: Path) -> list[str]:
    mods = modules(root)
    graph = {m: edges(m, p, set(mods)) for m, p in mods.items()}
    return ["; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in cycles(graph)]


def scratch_copy(tmp_path: Path) -> Path:
    """A copy of the package and its setup.cfg, to break on purpose."""
    shutil.copytree(ROOT, tmp_path / "celery_lease", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SETUP_CFG, tmp_path / "setup.cfg")
    return tmp_path / "celery_lease"


def lint_imports(where: Path) -> subprocess.CompletedProcess[str]:
    if not Path(LINT_IMPORTS).exists():
        pytest.skip("import-linter is not installed (the test extra installs it)")
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(where)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_package_has_no_import_cycle() -> None:
    found = cycles_in(ROOT)
    assert not found, "import cycles:\n" + "\n".join(found)


def test_a_cycle_inside_one_layer_is_found(tmp_path: Path) -> None:
    package = scratch_copy(tmp_path)
    assert not cycles_in(package)
    # Two modules of one layer that need each other, one of them only inside a function.
    with (package / "store" / "schema.py").open("a", encoding="utf-8") as f:
        f.write("\n\ndef _late():\n    from . import dialects  # noqa: F401\n")
    dialects = package / "store" / "dialects" / "__init__.py"
    if not dialects.exists():
        dialects = package / "store" / "dialects.py"
    with dialects.open("a", encoding="utf-8") as f:
        f.write('\n_HOOK = "celery_lease.store.schema:make_tables"\n')
    found = cycles_in(package)
    assert any("celery_lease.store.schema" in line and "celery_lease.store.dialects" in line
               for line in found)


def test_the_layer_contracts_hold_and_list_every_layer() -> None:
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    layers = config["importlinter:contract:layers"]["layers"]
    named = {part.strip() for line in layers.splitlines() for part in re.split(r"[:|]", line) if part.strip()}
    children = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert named == children
    result = lint_imports(ROOT.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module, line", [
    ("store/schema.py", "from celery_lease.worker import runtime  # noqa: F401\n"),  # a layer reaching up
    ("deadline.py", "import kombu  # noqa: F401\n"),  # the core importing kombu
])
def test_make_lint_fails_on_an_import_that_breaks_a_contract(tmp_path: Path, module: str, line: str) -> None:
    package = scratch_copy(tmp_path)
    with (package / module).open("a", encoding="utf-8") as f:
        f.write("\n\ndef _late():\n    " + line)
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout.upper(), result.stdout + result.stderr


MAX_MODULE_LINES = 400  # a module past it holds more than one job


def test_no_library_module_is_over_the_line_cap() -> None:
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in ROOT.rglob("*.py")}
    over = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert len(sizes) > 100 and over == {}, f"modules over {MAX_MODULE_LINES} lines: {over}"
