"""The shape of the code, checked from its imports: no circles, a contract that imports no runtime, roles that
talk only through the contract, and modules small enough to hold in mind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["protocol", "transfer", "runtime", "models", "tasks", "pools", "node", "coordinator", "verifier",
            "trainer", "testing", "swarmrl"]
ROLES = {"node", "coordinator", "verifier", "trainer"}
NETWORK_RUNTIMES = {"httpx", "hivemind", "fastapi", "uvicorn", "starlette", "requests", "aiohttp", "socket",
                    "sqlalchemy", "vllm"}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "swarmrl" else ["swarmrl", *parts])


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "migrations" not in path.parts or path.name == "env.py":
                out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imports(path: Path, name: str) -> set[str]:
    """Every module of ours or elsewhere that `path` imports (anywhere in the file, TYPE_CHECKING included)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _ours(imported: set[str]) -> set[str]:
    return {m for m in imported if m in MODULES}


GRAPH = {name: _ours(_imports(path, name)) - {name} for name, path in MODULES.items()}


def test_no_import_circles():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(GRAPH[node]):
            if seen.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, [*stack, nxt])
        seen[node] = 2

    for start in sorted(GRAPH):
        if start not in seen:
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_protocol_imports_nothing_but_itself_and_no_runtime():
    for name, path in MODULES.items():
        if not name.startswith("swarmrl.protocol"):
            continue
        imported = _imports(path, name)
        ours = {m for m in imported if m.startswith("swarmrl.") and not m.startswith("swarmrl.protocol")}
        runtimes = {m for m in imported if m.split(".")[0] in NETWORK_RUNTIMES}
        assert not ours and not runtimes, (name, ours, runtimes)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_never_imports_another_role(role):
    others = {f"swarmrl.{r}" for r in ROLES - {role}}
    for name, targets in GRAPH.items():
        if name.startswith(f"swarmrl.{role}"):
            bad = {t for t in targets if any(t == o or t.startswith(o + ".") for o in others)}
            assert not bad, (name, bad)


def test_no_module_is_too_long_to_hold_in_mind():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_file_holds_merge_conflict_markers():
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".txt", ".ini", ".cfg", ""}:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{name}:{i}" for i, line in enumerate(lines, 1) if line.startswith(markers)]
    assert not found, f"merge conflict markers left in: {found}"


def test_no_test_module_imports_another_and_bench_imports_no_test_code():
    """Shared fixtures live in tests/conftest.py and tests/support/; benchmarks use swarmrl.testing, never tests/."""
    offenders = []
    files = [*sorted((ROOT / "tests").glob("test_*.py")), *sorted((ROOT / "bench").glob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if path.parent.name == "bench" and (name == "tests" or name.startswith("tests.")):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
                if name.startswith("tests.test_") or (isinstance(node, ast.ImportFrom) and name == "tests"
                                                      and any(a.name.startswith("test_") for a in node.names)):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders
