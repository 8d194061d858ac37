"""The package layout rules: no backend package imports another; shared pieces live in ffpa_attn.common."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ffpa_attn"
BACKEND_PACKAGES = {"triton": PKG / "triton", "cute": PKG / "cute", "cuda": PKG / "cuda", "sdpa": PKG / "sdpa.py"}


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute ``ffpa_attn.*`` names imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = package.split(".")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ffpa_attn")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("ffpa_attn"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def _files(root: Path) -> list[tuple[Path, str]]:
    if root.is_file():
        return [(root, "ffpa_attn")]
    return [(p, "ffpa_attn." + ".".join(p.relative_to(PKG).parent.parts)) for p in sorted(root.rglob("*.py"))]


@pytest.mark.parametrize("name", sorted(BACKEND_PACKAGES))
def test_no_backend_package_imports_another(name):
    others = {f"ffpa_attn.{n}" for n in BACKEND_PACKAGES if n != name}
    bad = []
    for path, package in _files(BACKEND_PACKAGES[name]):
        for mod in _imported_modules(path, package):
            if any(mod == o or mod.startswith(o + ".") for o in others):
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, bad


def test_the_checker_sees_relative_imports(tmp_path):
    """The rule above would pass vacuously if relative imports were not resolved: check it on a sample."""
    f = tmp_path / "x.py"
    f.write_text("from ..triton.splitkv import sm_count\nfrom . import api\nimport ffpa_attn.cuda\n")
    mods = _imported_modules(f, "ffpa_attn.cute")
    assert {"ffpa_attn.triton.splitkv", "ffpa_attn.cute.api", "ffpa_attn.cuda"} <= mods
