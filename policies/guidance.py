"""Classifier-free guidance (CFG) branches, in one process or across two.

Single process: both branches run here and nothing is exchanged. CFG-parallel (two ranks of a
``torch.distributed`` group, gloo on CPU, NCCL on GPU): rank 0 runs the conditional branch,
rank 1 the unconditional one, each against its own KV pool, and every denoise step the two
noise predictions are exchanged so both ranks take the same scheduler step. The guidance
arithmetic is the same code either way, so CFG-parallel equals the single-process result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ardiff_kv import Branch


class Transport(Protocol):
    """How two CFG ranks meet: collective ops over equal-shaped tensors."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class TorchDistributed:
    """``torch.distributed`` collectives on a process group (None = the default group)."""

    group: Any = None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor


@dataclass(frozen=True)
class Guidance:
    local_branches: tuple[Branch, ...]
    rank: int = 0
    transport: Transport | None = None  # None: single process

    @classmethod
    def single(cls) -> Guidance:
        return cls(local_branches=(Branch.COND, Branch.UNCOND))

    @classmethod
    def parallel(cls, rank: int, transport: Transport | None = None) -> Guidance:
        """Rank 0 runs the conditional branch, rank 1 the unconditional one."""
        if rank not in (0, 1):
            raise ValueError(f"CFG-parallel uses exactly two ranks, got rank {rank}")
        return cls(local_branches=(Branch(rank),), rank=rank, transport=transport or TorchDistributed())

    @property
    def is_parallel(self) -> bool:
        return self.transport is not None

    def agree(self, failed: list[bool], device: torch.device | str = "cpu") -> list[bool]:
        """Which entries failed on any rank (every rank calls it with its own view): CFG ranks step
        the same sessions, so a failure on one is a failure on both, or their batches (and the
        collectives inside them) would fall out of step. One process: as given."""
        if self.transport is None or not failed:
            return list(failed)
        parts = self.transport.all_gather(torch.tensor(failed, dtype=torch.uint8, device=device))
        return [bool(x) for x in torch.stack(parts).amax(0).tolist()]

    def gather_video(self, local: dict[Branch, torch.Tensor]) -> dict[Branch, torch.Tensor]:
        """Both branches' video predictions, wherever they were computed."""
        if self.transport is None:
            return local
        (mine,) = local.values()
        cond, uncond = self.transport.all_gather(mine)
        return {Branch.COND: cond, Branch.UNCOND: uncond}

    def broadcast_from_cond(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The conditional branch's tensor (e.g. the action prediction) on every rank."""
        if self.transport is None:
            if tensor is None:
                raise RuntimeError("the conditional branch did not run in this process")
            return tensor
        return self.transport.broadcast(tensor if self.rank == 0 else torch.empty_like(like), src=0)
