"""Named-barrier ids of the CuTeDSL kernels (``bar.sync`` / ``bar.arrive``), one enum per kernel (no cutlass).

A CTA has 16 hardware barriers; id 0 is the CTA-wide barrier of ``cute.arch.sync_threads`` (every kernel's
prologue, after the mbarrier init), so a kernel names ids 1..15. Every id a kernel uses is a member of its
enum, and each enum is ``@enum.unique``: two users inside one kernel cannot share an id. Different kernels
never share a CTA, so their enums may reuse ids.
"""
from __future__ import annotations

import enum


@enum.unique
class FwdBarrier(enum.IntEnum):
    """Forward kernels (:mod:`.fwd_sm90`, :mod:`.fwd_sm90_recompute`)."""

    #: both consumers (256 threads): each wrote its partial S into the ring (cluster of 1; a 2-CTA cluster
    #: exchanges through an mbarrier instead)
    EXCHANGE = 1
    #: one consumer's warpgroup (128 threads): its O part is in shared memory, the TMA store may read it;
    #: consumer c uses ``EPILOGUE + c``
    EPILOGUE = 2
    EPILOGUE_1 = 3


@enum.unique
class DkDvBarrier(enum.IntEnum):
    """The backward dK/dV kernel (:mod:`.bwd_sm90`); both consumers, 256 threads."""

    #: consumer 0 arrives once P^T is in shared memory; consumer 1 waits before reading it
    P_WRITTEN = 1
    #: consumer 1 arrives once it has read P^T; consumer 0 waits before writing the next one
    P_READ = 2


@enum.unique
class DqBarrier(enum.IntEnum):
    """The backward dQ kernel (:mod:`.bwd_dq_sm90`); both consumers, 256 threads."""

    #: consumer 0 arrives once P is in shared memory; consumer 1 waits before reading it
    P_WRITTEN = 1
    #: both wait: consumer 1 wrote dS (fenced to the async proxy) for both consumers' dQ wgmma
    DS_WRITTEN = 2
