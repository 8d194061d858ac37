"""Every ``FFPA_ATTN_*`` environment variable: one registry (name, default, meaning) and one parser.

Read variables only through :func:`env_flag` / :func:`env_int` / :func:`env_str`; a name missing from :data:`REGISTRY` is a
KeyError, so the registry (and the README table printed by :func:`markdown_table`) lists every variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its default as the string a user would set (``""`` = unset), the kind of value and what
    it changes."""

    name: str
    default: str
    kind: str  # "flag" (0/1), "int" or "str"
    meaning: str


REGISTRY: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("FFPA_ATTN_CACHE_DIR", "", "str",
           "Root of the on-disk caches (Triton autotune results, CuTeDSL kernels, CUDA cubins); unset: "
           "`$XDG_CACHE_HOME/ffpa_attn`, else `~/.cache/ffpa_attn`."),
    EnvVar("FFPA_ATTN_TAIL_SPLIT", "1", "flag",
           "Run the partial last wave of the CUDA / CuTeDSL dense forward as a split-KV launch; 0 turns it off."),
    EnvVar("FFPA_ATTN_VARLEN_VALUE_CHECKS", "1", "flag",
           "Check the values of varlen `cu_seqlens` / `max_seqlen` on the host (one device sync per new boundary "
           "tensor; never during a CUDA-graph capture); 0 trusts the caller: malformed boundaries then give undefined "
           "output instead of a ValueError."),
    EnvVar("FFPA_ATTN_CUTE_DISK_CACHE", "1", "flag", "Keep compiled CuTeDSL kernels on disk for later processes."),
    EnvVar("FFPA_ATTN_CUTE_PARALLEL_COMPILE", "1", "flag",
           "Compile the further CuTeDSL kernels of a call in compile worker processes that see no GPU (children of "
           "one compile server that imported the compiler once; needs the disk cache); 0: every kernel compiles in "
           "the calling process."),
    EnvVar("FFPA_ATTN_CUTE_COMPILE_WORKERS", "3", "int",
           "Most CuTeDSL kernels compiling in compile workers at once (at least 1; the default covers the most "
           "kernels one first call hands over: the tail kernel and the backward's two)."),
    EnvVar("FFPA_ATTN_CUTE_ARCH", "sm_90a", "str", "Target arch of the CuTeDSL compiler."),
    EnvVar("FFPA_ATTN_CUDA_COMPILER", "", "str",
           "Compiler of the CUDA backend: `nvrtc` or `nvcc`; unset: NVRTC when found, else nvcc."),
    EnvVar("FFPA_ATTN_CUDA_ROWS_PER_WARP", "", "str",
           "Force 16 or 32 query rows per warp in the CUDA forward (benchmarks); unset: per-arch default."),
    EnvVar("FFPA_ATTN_COMPAT_OPS", "1", "flag",
           "Register the public ffpa-attn package's low-level op names (`torch.ops.ffpa_attn._fwd_cute`, ...); 0 "
           "leaves them to that package when the benchmark loads it in the same process, from its own folder under "
           "another module name (`FFPA_UPSTREAM_PATH`). Not a way to install both: they share the `ffpa_attn` "
           "folder, so one replaces the other."),
    EnvVar("FFPA_ATTN_HF_MASKS", "auto", "str",
           "Mask format of the transformers integration: `auto`, `block` (FlexAttention BlockMask) or `dense`."),
)}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_str(name: str) -> str:
    """The value of registered variable ``name`` (stripped), or its default when unset or empty."""
    var = REGISTRY[name]
    value = os.environ.get(name, "").strip()
    return value if value else var.default


def env_flag(name: str) -> bool:
    """A registered 0/1 variable: 1/true/yes/on or 0/false/no/off (any case); unset or empty = its default.

    Raises:
        ValueError: naming the variable, for any other value (a typo never silently means "off").
    """
    var = REGISTRY[name]
    if var.kind != "flag":
        raise TypeError(f"{name} is not a 0/1 variable")
    value = env_str(name).lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false), got {os.environ.get(name)!r}")


def env_int(name: str) -> int:
    """A registered integer variable; unset or empty = its default.

    Raises:
        ValueError: naming the variable, for a value that is not an integer.
    """
    var = REGISTRY[name]
    if var.kind != "int":
        raise TypeError(f"{name} is not an integer variable")
    value = env_str(name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {os.environ.get(name)!r}") from None


def markdown_table() -> str:
    """The registry as a markdown table (the README's list of environment variables)."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for v in REGISTRY.values():
        rows.append(f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {v.meaning} |")
    return "\n".join(rows)


__all__ = ["EnvVar", "REGISTRY", "env_flag", "env_int", "env_str", "markdown_table"]
