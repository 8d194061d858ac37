"""Pieces more than one kernel package needs, so that no backend package imports another.

* :mod:`.lse`: exact log-sum-exp merge of partial results (ring attention, tail split, split-KV).
* :mod:`.device`: device facts (capability, SM count, opt-in shared memory, GPU name, interpreter on/off).
* :mod:`.combine`: the split-KV combine kernel (Triton; Triton and CuTeDSL split-KV paths).
* :mod:`.delta`: the backward preprocess ``delta = rowsum(dO * O) - dlse`` (Triton; Triton and CuTeDSL backwards).
* :mod:`.env`: every ``FFPA_ATTN_*`` environment variable and its parser.
* :mod:`.causal`: the tail-aligned causal offset (torch-free; re-exported by :mod:`ffpa_attn.contract`).

Importing this package imports nothing heavy; :mod:`.device` imports torch, :mod:`.combine` and :mod:`.delta`
import triton. The on-disk caches live in :mod:`ffpa_attn.cache`.
"""
