"""Progress display for long sweeps: tqdm when installed (the ``bench`` extra), else plain lines."""
from __future__ import annotations

import sys
from typing import Any


class _Lines:
    """Minimal stand-in for a tqdm bar: one line per step on stderr."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.n, self.desc, self.enabled = total, 0, desc, enabled

    def set_description(self, desc: str, refresh: bool = True) -> None:
        del refresh
        self.desc = desc
        if self.enabled:
            print(f"[{self.n + 1}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str = "", enabled: bool = True) -> Any:
    """A progress bar over ``total`` steps with ``set_description`` / ``update`` / ``write`` / ``close``."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
        except ImportError:
            pass
    return _Lines(total, desc, enabled)
