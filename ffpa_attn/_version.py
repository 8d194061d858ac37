"""The package's version and the name pip knows it by (no imports: every layer may read it)."""

__version__ = "0.1.0"
# pyproject.toml's project.name; the public ffpa-attn on PyPI is another package that installs the same ffpa_attn
# folder
__distribution__ = "ffpa-attn-kernels"
