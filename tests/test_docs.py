"""The documents stay in step with the code: the README's environment-variable table is the registry's, and every
section of docs/design.md that the code points at exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ffpa_attn.common.env import markdown_table

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("Contract", "Architecture", "Kernel-module protocol", "Errors and tolerances", "Triton kernels",
            "CuTeDSL kernels", "CUDA kernels", "Dispatch heuristics")


def test_readme_env_table_is_the_registry():
    assert markdown_table() in (ROOT / "README.md").read_text(), \
        "README's environment-variable table differs from ffpa_attn.common.env.markdown_table(): paste its output"


def test_design_sections_the_code_points_at_exist():
    headings = set(re.findall(r"^## (.+)$", (ROOT / "docs" / "design.md").read_text(), flags=re.M))
    assert set(SECTIONS) <= headings, sorted(set(SECTIONS) - headings)
    try:
        src = subprocess.run(["git", "grep", "-h", "design.md", "--", "ffpa_attn", "tests", "bench", "README.md"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git checkout")
    cited = set(re.findall(r'design\.md`?,? (?:section )?"([A-Z][A-Za-z -]+)"', src))
    assert cited and cited <= headings, sorted(cited - headings)
