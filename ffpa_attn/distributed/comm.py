"""The ring's only transport: send a buffer to the next rank while receiving one from the previous rank.

Built on ``torch.distributed.batch_isend_irecv`` (NCCL on GPUs, gloo on CPU). A transfer is started before
the step's compute and waited on after it, so the next step's data is in flight while this step computes.
Every rank issues the same sequence of transfers, which keeps sends and receives matched in order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Pending:
    """A started transfer; :meth:`wait` returns the received buffer."""

    def __init__(self, works: list, recv: torch.Tensor, send: torch.Tensor | None = None) -> None:
        self._works = works
        self._recv = recv
        self._send = send  # kept alive until the transfer completes

    def wait(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._send = [], None
        return self._recv


class RingComm:
    """Neighbours of this rank in ``group`` (default: the world) arranged as a ring ``r -> r+1``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ring attention needs torch.distributed initialized (dist.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def start(self, send: torch.Tensor, tag: int = 0) -> Pending:
        """Send ``send`` (contiguous) to the next rank; receive a same-shaped buffer from the previous one.

        ``tag`` separates message streams on backends that match by tag (gloo); NCCL matches in order.
        """
        recv = torch.empty_like(send)
        if self.world == 1:
            recv.copy_(send)
            return Pending([], recv)
        ops = [dist.P2POp(dist.isend, send, self._next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self._prev, self.group, tag)]
        return Pending(dist.batch_isend_irecv(ops), recv, send)
