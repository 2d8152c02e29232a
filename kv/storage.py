"""Where KV lives: the per-layer page tensors, the scratch region and the cross-attention slots.

Layout per layer: a K tensor and a V tensor, each ``(num_pages_total, page_size, heads, head_dim)``,
which a block-table kernel reads in place and the sdpa path gathers from. Page ids
``1 .. pool_pages - 1`` belong to the :class:`~ardiff_kv.pool.PagePool` (0 is the null page); the pages
after them are scratch, K/V that is never committed: one region per local CFG branch and batch
slot, so that the sequences of a batched forward (several sessions' denoise steps in one
forward) never write over each other.
Cross-attention K/V sit in static per-layer slot tensors, one slot per session branch.

This module knows shapes and addresses only; who owns which page is ``pool.py`` and
``session.py``'s business, admission is ``cache.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ardiff_kv.attention import allow_batch_shapes
from ardiff_kv.pool import CapacityError
from ardiff_kv.spec import Branch, CrossKV, KVSpec


class CrossAttentionSlots:
    """Static per-layer cross-attention K/V, one slot per session branch.

    Written once per session (text) or window (image tokens) and read every denoise step.
    """

    def __init__(self, spec: KVSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        shape = (num_slots, spec.cross_tokens, spec.num_heads, spec.head_dim)
        self._keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def acquire(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.num_slots} cross-attention slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"cross-attention slot {slot} released twice or never acquired")
        self._free.append(slot)

    def write(
        self,
        slot: int,
        layer: int,
        *,
        text: tuple[torch.Tensor, torch.Tensor] | None,
        image: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        n_text = self.spec.cross_text_tokens
        for part, span in ((text, slice(0, n_text)), (image, slice(n_text, self.spec.cross_tokens))):
            if part is None:
                continue
            key, value = part
            expected = (span.stop - span.start, self.spec.num_heads, self.spec.head_dim)
            if tuple(key.shape[-3:]) != expected or tuple(value.shape[-3:]) != expected:
                raise ValueError(f"cross K/V of shape {tuple(key.shape)} does not fit the slot {expected}")
            self._keys[layer][slot, span].copy_(key.reshape(expected))
            self._values[layer][slot, span].copy_(value.reshape(expected))

    def read(self, slot: int, layer: int) -> CrossKV:
        n_text = self.spec.cross_text_tokens
        keys, values = self._keys[layer][slot : slot + 1], self._values[layer][slot : slot + 1]
        has_image = self.spec.cross_image_tokens > 0
        return CrossKV(
            text_key=keys[:, :n_text],
            text_value=values[:, :n_text],
            image_key=keys[:, n_text:] if has_image else None,
            image_value=values[:, n_text:] if has_image else None,
        )


class PagedStorage:
    """The tensors of one rank's cache: ``pool_pages`` pool pages (null page included), then
    ``scratch_pages_per_branch`` scratch pages per local branch and batch slot (``max_batch``
    sessions per forward); cross slots for ``max_sessions`` sessions x local branches (the cache
    passes the sessions its pool holds)."""

    def __init__(
        self,
        spec: KVSpec,
        *,
        pool_pages: int,
        max_sessions: int,
        branches: Sequence[Branch],
        device: torch.device,
        attention_backend: str,
        max_batch: int = 1,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.spec = spec
        self.device = device
        self.branches = tuple(branches)
        self.attention_backend = attention_backend
        self.max_batch = max_batch
        if attention_backend == "flex":  # its kernel is compiled per query shape
            allow_batch_shapes(max_batch, len(self.branches))
        self._scratch_base = pool_pages
        total = pool_pages + max_batch * len(self.branches) * spec.scratch_pages_per_branch
        # K and V are separate base tensors per layer (not views of one): the paged op mutates them
        # in place, and torch.compile can only re-inplace a mutation of a whole graph input; a
        # view into a shared base makes inductor copy the whole layer pool around every call.
        # Zeros, not empty: padded table entries may be read by a kernel; keep them finite.
        shape = (total, spec.page_size, spec.num_heads, spec.head_dim)
        self._keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.cross = CrossAttentionSlots(spec, max_sessions * len(self.branches), device) if spec.cross_tokens else None

    def key_cache(self, layer: int) -> torch.Tensor:
        return self._keys[layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def check_local(self, branch: Branch) -> None:
        if branch not in self.branches:
            raise RuntimeError(f"branch {Branch(branch).name} does not run on this rank (local: {self.branches})")

    def scratch_pages(self, branch: Branch, slot: int = 0) -> list[int]:
        """The scratch region of ``branch`` for the ``slot``-th session of a batched forward:
        ``max_new_pages`` video pages, then the extra pages."""
        self.check_local(branch)
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"scratch slot {slot} outside the batch of {self.max_batch}")
        per_branch = self.spec.scratch_pages_per_branch
        start = self._scratch_base + (slot * len(self.branches) + self.branches.index(branch)) * per_branch
        return list(range(start, start + per_branch))

    @property
    def nbytes(self) -> int:
        pages = sum(t.numel() * t.element_size() for t in self._keys + self._values)
        return pages + (self.cross.nbytes if self.cross is not None else 0)


def device_free_bytes(device: torch.device | str) -> int:
    """Free memory of a device now: CUDA's free memory (a context on that device is created), or the
    host's available RAM. What the engine sizes a fraction-based KV pool from, and what a policy's
    memory plan checks against."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    return host_available_bytes()


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import psutil  # not Linux

        return int(psutil.virtual_memory().available)
