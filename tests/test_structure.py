"""The house rules, checked on the source (docs: the rooms in README.md, daemon/README.md,
client/README.md): which room may import which, no import cycles, imports at the top of the
file, files of a size one can read, no work-log labels."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("client", "daemon", "proto", "csrc", "cli", "bench", "embedded", "hf")
# Who may import whom (the package's own modules only). A room not listed for another is
# above it or beside it: the engine's library and the daemon never import each other.
ALLOWED = {
    "proto": {"proto"},
    "csrc": {"csrc", "proto"},
    "client": {"client", "proto", "csrc"},
    "daemon": {"daemon", "proto", "csrc"},
    "embedded": {"embedded", "client", "daemon", "proto", "csrc"},
    # the transformers integration: an engine, so the engine's library only (and torch,
    # transformers); an in-process engine is the caller's to pass in.
    "hf": {"hf", "client", "proto"},
    "bench": {"bench", "embedded", "hf", "client", "daemon", "proto", "csrc"},
    "cli": {"cli", "bench", "embedded", "client", "daemon", "proto", "csrc"},
}
# Imports of the package's own modules inside functions: lazy only where a cycle or a
# heavy import (torch, CuPy behind it) would otherwise be paid by every user.
MAX_LAZY_IMPORTS = 10
MAX_LINES = 600  # outside csrc/; a longer file says why at its top ("Longer than")
WORK_LOG = re.compile(r"\b[Ss]ession \d+\b|\bs\d{1,2}['’]s\b|\bsession-\d+\b")


def modules() -> dict[str, Path]:
    found = {"sparsekv": ROOT / "__init__.py"}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join(["sparsekv", *parts])] = path
    return found


MODULES = modules()


@functools.cache
def tree(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for every check of it."""
    return ast.parse(path.read_text(), str(path))


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package's own modules an import statement names (absolute names)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".")
            is_pkg = MODULES[module].name == "__init__.py"
            pkg = pkg if is_pkg else pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return sorted({n for n in names if n in MODULES or n.startswith("sparsekv.")})


@functools.cache
def _imports_by_place() -> dict[str, dict[bool, set[str]]]:
    """module -> {False: own modules it imports at module level, True: inside functions}."""
    out = {}
    for module, path in MODULES.items():
        funcs = [n for n in ast.walk(tree(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inner = {id(n) for f in funcs for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        found = {False: set(), True: set()}
        for node in ast.walk(tree(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found[id(node) in inner].update(n for n in _resolve(module, node) if n != module)
        out[module] = found
    return out


def imports(lazy: bool | None) -> dict[str, set[str]]:
    """module -> own modules it imports at module level (lazy=False), inside functions
    (lazy=True) or anywhere (None)."""
    return {module: found[False] | found[True] if lazy is None else set(found[lazy])
            for module, found in _imports_by_place().items()}


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else "sparsekv"


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for lazy in (False, True):
        for module, targets in imports(lazy).items():
            if room(module) == "sparsekv":
                continue
            wrong += [f"{module} -> {t}" for t in targets if room(t) not in ALLOWED[room(module)]]
    assert not wrong, "imports across the house's rules:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = imports(lazy=None)  # a cycle closed by an import inside a function is one too
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_few_imports_of_the_package_inside_functions():
    lazy = []  # one entry per import statement
    for module, path in MODULES.items():
        for func in ast.walk(tree(path)):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lazy += [f"{path.relative_to(ROOT)}:{n.lineno} -> {', '.join(_resolve(module, n))}"
                         for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))
                         and n.lineno > func.lineno and _resolve(module, n)]
    lazy = sorted(set(lazy))
    assert len(lazy) <= MAX_LAZY_IMPORTS, f"{len(lazy)} imports inside functions:\n" + "\n".join(lazy)


OTHER_PY = sorted(p for r in ("tests", "examples") for p in (ROOT / r).rglob("*.py"))


@pytest.mark.parametrize("path", sorted(MODULES.values()) + OTHER_PY, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_readable(path):
    text = path.read_text()
    lines = text.count("\n")
    if lines > MAX_LINES:
        assert "Longer than" in text[:3000], f"{path.relative_to(ROOT)}: {lines} lines and no reason at its top"


def test_no_work_log_labels_in_code_or_docs():
    paths = [p for r in (*ROOMS, "docs", "examples", "deploy", "tests") for p in (ROOT / r).rglob("*")
             if p.is_file() and p.suffix in (".py", ".md", ".cu", ".cuh", ".sh", ".toml")]
    paths += [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    hits = []
    for path in paths:
        if path == Path(__file__):
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORK_LOG.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, f"{len(hits)} work-log labels:\n" + "\n".join(hits[:40])
