"""Collectives of one tensor-parallel rank: torch.distributed over NCCL (CUDA) or gloo (CPU).

A process holds at most one rank (torch.distributed's default group). Rank 0 hosts
the rendezvous store. Tensor collectives go over the device backend; step messages
(pickled host objects) over a gloo group of their own, whose wait has no practical
timeout: an idle engine sends nothing for as long as it is idle, and a rank that
dies closes its sockets, which fails the peers' waits at once. Every call counts
its payload bytes by tag, so the benchmark can report what one step sends.
"""

from __future__ import annotations

import pickle
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replica.device import collective_backend

IDLE_TIMEOUT = timedelta(days=365)


class TPComm:
    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.backend = collective_backend(device)
        self.bytes: Counter[str] = Counter()  # payload bytes this rank sent, per tag
        self.calls: Counter[str] = Counter()
        self._store: dist.Store | None = None
        self._meta: Any = None  # the gloo group of step messages

    def listen(self, host: str, timeout_s: float) -> int:
        """Rank 0: open the rendezvous store; returns the port the other ranks join."""
        self._store = dist.TCPStore(
            host, 0, self.size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        return self._store.port

    def join(self, host: str, port: int, timeout_s: float) -> None:
        """Enter the group; returns once every rank has. `timeout_s` also bounds each
        tensor collective (a peer that stops answering without dying)."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already holds a tensor-parallel rank: "
                "one tensor-parallel engine per process"
            )
        timeout = timedelta(seconds=timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(host, port, self.size, is_master=False, timeout=timeout)
        dist.init_process_group(
            self.backend, store=self._store, rank=self.rank, world_size=self.size, timeout=timeout
        )
        self._meta = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = self._meta = None

    def all_reduce(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Sum `t` over ranks, in place."""
        self._count(tag, t.nbytes)
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Every rank's `t`, concatenated along the last dim in rank order."""
        self._count(tag, t.nbytes)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None, tag: str = "step") -> Any:
        """Rank 0's `obj` on every rank (the others pass nothing): pickled once, sent as a
        length and a byte buffer."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
            self._count(tag, data.nbytes + length.nbytes)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, 0, group=self._meta)
        if self.rank != 0:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self._meta)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _count(self, tag: str, nbytes: int) -> None:
        self.bytes[tag] += nbytes
        self.calls[tag] += 1
