"""The package's layout rules, read from the source: Transformer Engine has one home, and no module imports
itself back through another (at module level or inside a function)."""
import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "titan_te"
# fields of TE's FP8 tensors and modules that only titan_te/te/ may read or write
FP8_INTERNALS = {"_data", "_scale_inv", "_quantizer", "_reset_caches", "_transpose", "_fp8_dtype",
                 "_high_precision_init", "_rowwise_data", "_columnwise_data"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imported(module: str, path: Path, modules: dict) -> set[str]:
    """The titan_te modules `module` imports anywhere in its file (a name imported from a package is its
    submodule when one has that name)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back_through_another():
    """A registry's package imports its members so that they register, and they import the registry from it:
    that pattern is allowed (a package's edges to its own members are left out); any other loop is not."""
    modules = _modules()
    graph = {m: {t for t in _imported(m, p, modules) if not (p.name == "__init__.py" and t.startswith(m + "."))}
             for m, p in modules.items()}
    assert _cycles(graph) == []


def test_only_titan_te_te_imports_transformer_engine_or_reads_fp8_internals():
    offenders = []
    for f in PACKAGE.rglob("*.py"):
        if f.is_relative_to(PACKAGE / "te"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "transformer_engine" for n in names):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno} imports transformer_engine")
            if (isinstance(node, ast.Attribute) and node.attr in FP8_INTERNALS
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert offenders == []


# pytest's own selection for each list of arguments, in one interpreter (torch and the test modules imported
# once, not once per selection): the node ids each would run
SELECTION = """
import json, sys
import pytest

class Selected:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

runs = []
for args in json.loads(sys.argv[1]):
    seen = Selected()
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args], plugins=[seen])
    runs.append(seen.ids)
print("SELECTED " + json.dumps(runs))
"""


def test_the_gpu_script_runs_every_gpu_test_once():
    """scripts/test_gpu.sh selects the GPU suite by file and -k expression per group: every test marked gpu
    falls in exactly one group (a new test no expression matches would never run on a GPU)."""
    import json
    import os
    import re
    import subprocess
    import sys

    script = (ROOT / "scripts" / "test_gpu.sh").read_text()
    groups = re.findall(r"^\w+\(\) \{ group (\w+) ((?:tests/\S+ ?)+)(?:-k \"([^\"]+)\")?; \}", script, re.M)
    assert {g[0] for g in groups} == {"layers", "tracking_1b", "acceptance", "shared_tracking", "shared_state",
                                      "shared_elastic", "shared_memory", "shared_launcher", "auto"}
    runs = [files.split() + (["-k", expr] if expr else []) for _, files, expr in groups]
    runs.append(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")))  # every GPU test
    r = subprocess.run([sys.executable, "-c", SELECTION, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # pytest's own only
    *per_group, every = json.loads(r.stdout.rsplit("SELECTED ", 1)[-1]) if "SELECTED " in r.stdout else [[]]
    assert len(every) > 40 and sorted(t for ids in per_group for t in ids) == sorted(every), r.stdout[-3000:]
    assert all(per_group), [g for g, ids in zip(groups, per_group) if not ids]  # no group selects nothing
