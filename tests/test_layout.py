"""The package layout rules, read from the source (every import statement, also those inside functions):

* the import graph has no cycle;
* no backend package (``triton/``, ``cutedsl/``, ``cuda/``, ``sdpa/``) imports another, nor anything above it (the
  dispatch, the interface, the torch ops, the bindings): a kernel package sees only the shared layer below it;
* the shared layer (``dispatch/``, ``common/``, ``cache/``, ``contract``, ``config``, ``kernel_module``) imports no backend
  package: the dispatch learns what a backend can run from the backend's ``backend.json``, never from its code.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ffpa_attn"
BACKEND_PACKAGES = ("ffpa_attn.triton", "ffpa_attn.cutedsl", "ffpa_attn.cuda", "ffpa_attn.sdpa")
# what a backend package may import from the rest of ffpa_attn: the layer below it
BELOW_BACKENDS = ("ffpa_attn.common", "ffpa_attn.contract", "ffpa_attn.config", "ffpa_attn.kernel_module",
                  "ffpa_attn.reference", "ffpa_attn._version", "ffpa_attn.cache")
SHARED = ("ffpa_attn.dispatch", "ffpa_attn.common", "ffpa_attn.cache", "ffpa_attn.contract", "ffpa_attn.config",
          "ffpa_attn.kernel_module")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imported_modules(path: Path, name: str) -> set[str]:
    """The modules of ``ffpa_attn`` that ``path`` (module ``name``) imports anywhere (relative imports resolved;
    ``from pkg import sub`` counts ``pkg.sub``, and ``pkg`` itself only for names defined in it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES}
            out |= subs
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m.startswith("ffpa_attn") and m != name}


GRAPH = {name: {m for m in imported_modules(path, name) if m in MODULES} for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert not cycles(GRAPH), cycles(GRAPH)


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_a_backend_package_imports_only_the_layer_below(package):
    bad = []
    for name in (n for n in GRAPH if _within(n, package)):
        for mod in GRAPH[name]:
            if not (_within(mod, package) or any(_within(mod, b) for b in BELOW_BACKENDS)):
                bad.append(f"{name} imports {mod}")
    assert not bad, bad


@pytest.mark.parametrize("layer", SHARED)
def test_the_shared_layer_imports_no_backend_package(layer):
    bad = [f"{name} imports {mod}" for name in GRAPH if _within(name, layer)
           for mod in GRAPH[name] if any(_within(mod, b) for b in BACKEND_PACKAGES)]
    assert not bad, bad


def test_every_backend_package_has_a_description():
    from ffpa_attn.dispatch.registry import BACKEND_PACKAGES as REGISTERED

    assert set(REGISTERED) == set(BACKEND_PACKAGES)
    for package in BACKEND_PACKAGES:
        assert (PKG / package.split(".")[1] / "backend.json").is_file(), package


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    """The rules above would pass vacuously if relative or function-level imports were missed: check a sample."""
    f = tmp_path / "x.py"
    f.write_text("from ..triton.splitkv import sm_count\nfrom . import api\n\ndef g():\n    import ffpa_attn.cuda\n")
    mods = imported_modules(f, "ffpa_attn.cutedsl.x")
    assert {"ffpa_attn.triton.splitkv", "ffpa_attn.cutedsl.api", "ffpa_attn.cuda"} <= mods
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
