"""``python -m ffpa_attn``: see :mod:`ffpa_attn.cli` (imports no kernel, so the CLI can still decide
TRITON_INTERPRET before triton is first imported)."""
from .cli import main

raise SystemExit(main())
