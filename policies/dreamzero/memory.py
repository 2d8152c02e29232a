"""The memory plan of one DreamZero engine process: what it puts on each device, before any weight is loaded.

Per device the plan adds up:

* weights: exact parameter counts of the four networks, built on the meta device from the
  checkpoint's configs (nothing is allocated), times the engine dtype's size;
* the KV pool exactly as the engine sizes it (``ardiff_kv.kv_budget_bytes``, then
  ``ardiff_kv.PagedKVCache.pages_for_budget`` on the policy's ``KVSpec``): pages, scratch, the null page
  and the cross-attention slots of every session the pool holds;
* activations: an estimate of the largest phase that runs there (a DiT forward, a VAE encode or
  decode, a text / image encode; phases run one after another, so the largest counts), see
  :func:`activation_bytes`; a DiT forward holds every session of a batch x every CFG branch this
  process runs, a VAE encode every session of a batch;
* on CUDA a fixed reserve for what PyTorch does not account as tensors (cuBLAS / cuDNN
  workspaces, NCCL buffers, allocator fragmentation): a prior, not measured, and printed as such.

:meth:`MemoryPlan.check` compares that with the free memory of each device (injected: the
worker passes ``torch.cuda.mem_get_info``, tests pass numbers) and raises :class:`MemoryPlanError`
with one line naming the device, the need, what is free and the settings that would make it fit
(found by re-planning with each of them).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ardiff_kv import KVSpec, PagedKVCache, kv_budget_bytes
from ardiff_kv.storage import device_free_bytes as free_bytes
from ardiff_kv.storage import host_available_bytes  # noqa: F401
from ardiff_policies.base import RuntimeOptions, StartRefused
from ardiff_policies.dreamzero.dit import DiTConfig
from ardiff_policies.dreamzero.transforms import video_size
from ardiff_policies.wan.memory import (
    CUDA_RESERVE_BYTES,
    ComponentSize,
    GiB,
    encoder_bytes,
    itemsize,
    module_size,
    transformer_forward_bytes,
    vae_chunk_bytes,
)

COMPONENTS = ("dit", "text_encoder", "image_encoder", "vae")
LABELS = {"dit": "DiT", "text_encoder": "text encoder", "image_encoder": "image encoder", "vae": "VAE"}

logger = logging.getLogger(__name__)


class MemoryPlanError(StartRefused):
    """The plan does not fit a device; the message is one line with the fix."""


# ------------------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class ModelGeometry:
    """What the plan needs to know about a DreamZero model: sizes from the meta device, shapes from configs."""

    name: str
    dit: DiTConfig
    sizes: Mapping[str, ComponentSize]  # by COMPONENTS
    text: Mapping[str, Any]  # UMT5Config fields
    image: Mapping[str, Any]  # CLIPVisionConfig fields
    vae: Mapping[str, Any]  # AutoencoderKLWan config
    canvas: tuple[int, int]  # (h, w) of the frames the VAE encodes
    num_frames: int = 33  # frames of the window-start image conditioning

    @property
    def parameters(self) -> int:
        return sum(size.floating for size in self.sizes.values())


def geometry_from_modules(
    name: str, dit: nn.Module, text_encoder: nn.Module, image_encoder: nn.Module, vae: nn.Module, *, canvas: tuple[int, int], num_frames: int = 33
) -> ModelGeometry:
    """Sizes of modules built on the meta device (tied tensors counted once) and their configs."""
    modules = {"dit": dit, "text_encoder": text_encoder, "image_encoder": image_encoder, "vae": vae}
    return ModelGeometry(
        name=name,
        dit=dit.config,
        sizes={key: module_size(module) for key, module in modules.items()},
        text=_config_of(text_encoder).to_dict(),
        image=_config_of(image_encoder).to_dict(),
        vae=dict(_config_of(vae)),
        canvas=canvas,
        num_frames=num_frames,
    )


def checkpoint_geometry(checkpoint: str | Path, view_size: Sequence[int] | None) -> ModelGeometry:
    """A checkpoint directory's geometry: its config.json read and its networks built on the meta device. The
    canvas the VAE sees is the checkpoint's resize target (the 5B), else the stitched views (``view_size``;
    None: the 14B's 176x320)."""
    from ardiff_policies.dreamzero.checkpoint import CheckpointDir
    from ardiff_policies.dreamzero.model import meta_modules
    from ardiff_policies.hub import snapshot_label

    ckpt = CheckpointDir(checkpoint)
    head, _, modules = meta_modules(ckpt)
    name = snapshot_label(checkpoint) or str(checkpoint)
    canvas = video_size("droid", tuple(view_size or (176, 320)), head.target_video_size)
    return geometry_from_modules(name, *modules, canvas=canvas, num_frames=head.num_frames)


def synthetic_geometry(checkpoint: str) -> ModelGeometry:
    """A ``synthetic:`` checkpoint's geometry: the canvas its VAE sees, the resize target (the 5B) or its stitched views."""
    from ardiff_policies.dreamzero.synthetic import meta_modules, parse_spec

    spec = parse_spec(checkpoint)
    canvas = video_size("droid", spec.view_size, spec.head.target_video_size)
    return geometry_from_modules(checkpoint, *meta_modules(spec), canvas=canvas, num_frames=spec.head.num_frames)


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlanSettings:
    """Where things go and how the KV pool is sized (the engine's and the policy's settings)."""

    engine_device: str  # the DiT's, the VAE's and the KV cache's
    dtype: torch.dtype = torch.bfloat16
    text_encoder_device: str = "engine"
    image_encoder_device: str = "engine"
    branches: int = 2  # CFG branches this process runs (1 under CFG-parallel or without guidance)
    cfg_parallel_size: int = 1
    max_sessions: int = 8
    kv_budget_gib: float | None = None  # None: kv_memory_fraction of what the weights leave free
    kv_memory_fraction: float = 0.5
    max_batch: int = 1  # sessions per forward (engine.max_batch): scratch pages and the DiT / VAE activations scale with it
    # Engine processes on this machine that each place the same encoders on its CPU (the CFG ranks
    # of a replica): a CUDA engine's host part is needed once per process, and checked for all at once.
    host_processes: int = 1

    def device_of(self, component: str) -> str:
        wanted = {"text_encoder": self.text_encoder_device, "image_encoder": self.image_encoder_device}.get(component, "engine")
        return resolve_device(wanted, self.engine_device)


def resolve_device(wanted: str, engine_device: str) -> str:
    """``engine`` -> the engine's device; ``cuda`` -> the engine's GPU if it has one, else cuda:0."""
    if wanted == "engine":
        return engine_device
    if wanted == "cuda":
        return engine_device if engine_device.startswith("cuda:") else "cuda:0"
    return wanted


@dataclass(frozen=True)
class KVPlan:
    spec: KVSpec
    branches: int
    max_sessions: int
    pages: int  # pool pages as the engine sizes them (the null page and scratch excluded)
    max_batch: int = 1  # scratch for this many sessions per forward

    @property
    def session_pages(self) -> int:
        return self.branches * self.spec.pages_per_branch

    @property
    def session_bytes(self) -> int:
        """One session at its worst: its pages in every local branch plus its cross-attention slots."""
        return self.session_pages * self.spec.page_bytes + self.branches * self.spec.cross_slot_bytes

    @property
    def pool_bytes(self) -> int:
        """What the engine allocates: pages + null page + scratch, and the cross slots of the sessions the pool holds."""
        spec = self.spec
        pages = self.pages + 1 + self.max_batch * self.branches * spec.scratch_pages_per_branch
        return pages * spec.page_bytes + self.sessions * self.branches * spec.cross_slot_bytes

    @property
    def sessions(self) -> int:
        """Sessions whose worst case the pool holds at once."""
        return min(self.max_sessions, self.pages // self.session_pages)


@dataclass(frozen=True)
class DevicePlan:
    device: str
    weights: Mapping[str, int]  # component -> bytes on this device
    activations: int
    reserve: int
    kv: KVPlan | None = None
    processes: int = 1  # engine processes holding this part on the device (the host's CPU encoders, once per CFG rank)

    @property
    def total(self) -> int:
        return self.processes * (sum(self.weights.values()) + (self.kv.pool_bytes if self.kv else 0) + self.activations + self.reserve)


@dataclass(frozen=True)
class MemoryPlan:
    geometry: ModelGeometry
    settings: PlanSettings
    devices: tuple[DevicePlan, ...]
    free: Mapping[str, int] = field(default_factory=dict)  # bytes free per device when planned (the CPU's too: remedies move encoders there)
    unchecked: frozenset[str] = frozenset()  # devices another process checks for this one (the host, for CFG rank 1)

    def device(self, name: str) -> DevicePlan:
        return next(d for d in self.devices if d.device == name)

    def shortfalls(self) -> list[DevicePlan]:
        return [d for d in self.devices if d.device in self.free and d.device not in self.unchecked and d.total > self.free[d.device]]

    def describe(self) -> str:
        """A table per device, for the start-up log."""
        s = self.settings
        lines = [
            f"memory plan: {self.geometry.name} ({_count(self.geometry.parameters)} parameters, {str(s.dtype).removeprefix('torch.')}), "
            f"{s.branches} CFG branch(es) in this process"
        ]
        for d in self.devices:
            free = f"{_size(self.free[d.device])} free" if d.device in self.free else "free unknown"
            fits = "" if d.device not in self.free else ("  fits" if d.total <= self.free[d.device] else "  DOES NOT FIT")
            if d.device in self.unchecked:
                fits = "  (checked by rank 0 for every rank)"
            each = f" ({d.processes} processes: every CFG rank holds its own)" if d.processes > 1 else ""
            lines.append(f"  {d.device}: needs {_size(d.total)}{each}, {free}{fits}")
            for component, size in d.weights.items():
                lines.append(f"    {LABELS[component] + ' weights':<24}{_size(size):>11}")
            if d.kv is not None:
                kv = d.kv
                lines.append(
                    f"    {'KV pool':<24}{_size(kv.pool_bytes):>11}  ({kv.pages} pages of {_size(kv.spec.page_bytes)}; a session: "
                    f"{kv.session_pages} pages + {kv.branches} cross slot(s) = {_size(kv.session_bytes)}; {kv.sessions} of max_sessions "
                    f"{kv.max_sessions} fit at once; scratch for {kv.max_batch} per forward)"
                )
            lines.append(f"    {'activations (estimate)':<24}{_size(d.activations):>11}")
            if d.reserve:
                lines.append(f"    {'CUDA reserve':<24}{_size(d.reserve):>11}  (unmeasured: a fixed prior for workspaces and fragmentation)")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise MemoryPlanError (one line with the fix) if a device cannot hold its part."""
        short = self.shortfalls()
        if not short:
            return
        worst = short[0]
        fix = suggest_fix(self)
        raise MemoryPlanError(
            f"memory plan: needs {worst.total / GiB:.1f} GiB on {worst.device}, has {self.free[worst.device] / GiB:.1f} GiB free "
            f"({_breakdown(worst)}): {fix}"
        )


def plan_memory(geometry: ModelGeometry, settings: PlanSettings, free: Mapping[str, int] | None = None) -> MemoryPlan:
    """The plan of one engine process. ``free`` (bytes per device) sizes a fraction-based KV pool
    the way the engine does (a fraction of what the weights leave free) and is what :meth:`MemoryPlan.check`
    compares against; without it the pool is the budget's, or the floor of one session."""
    free = dict(free or {})
    dtype = settings.dtype
    engine = settings.engine_device
    by_device: dict[str, dict[str, int]] = {}
    for component in COMPONENTS:
        by_device.setdefault(settings.device_of(component), {})[component] = geometry.sizes[component].bytes(dtype)
    by_device.setdefault(engine, {})
    spec = dit_kv_spec(geometry.dit, dtype)
    # The engine measures what is free once the weights are loaded; the plan predicts it.
    sizing = {"max_sessions": settings.max_sessions, "num_branches": settings.branches}
    most = PagedKVCache.bytes_for_sessions(spec, **sizing, max_batch=settings.max_batch)
    budget = kv_budget_bytes(settings.kv_budget_gib, settings.kv_memory_fraction, free.get(engine, 0) - sum(by_device[engine].values()), most=most)
    # The batch the engine will run: engine.max_batch, or fewer if the pool cannot hold that many sessions at once.
    batch = PagedKVCache.batch_for_budget(spec, budget, **sizing, max_batch=settings.max_batch)
    kv = KVPlan(spec, settings.branches, settings.max_sessions, pages_for_budget(spec, budget, **sizing, max_batch=batch), batch)
    phases = activation_bytes(geometry, dtype)
    phases["dit"] *= batch * settings.branches  # one DiT forward: a sequence per session x local CFG branch
    phases["vae"] *= batch  # one encode per session of a batch (both branches read its latents)
    devices = []
    for device, weights in by_device.items():
        here = [c for c in COMPONENTS if settings.device_of(c) == device]
        activations = max(phases[c] for c in here) if here else 0
        reserve = CUDA_RESERVE_BYTES if device.startswith("cuda") else 0
        processes = settings.host_processes if device == "cpu" and device != engine else 1
        devices.append(DevicePlan(device, weights, activations, reserve, kv if device == engine else None, processes))
    devices.sort(key=lambda d: (d.device != engine, d.device))
    return MemoryPlan(geometry, settings, tuple(devices), free)


def pages_for_budget(spec: KVSpec, budget: int, *, max_sessions: int, num_branches: int, max_batch: int = 1) -> int:
    """The engine's pool size (``PagedKVCache.pages_for_budget``) without its floor warning: a plan
    may try budgets that the engine would never be given."""
    import logging

    cache_logger = logging.getLogger("ardiff_kv.cache")
    level = cache_logger.level
    cache_logger.setLevel(logging.ERROR)
    try:
        return PagedKVCache.pages_for_budget(spec, budget, max_sessions=max_sessions, num_branches=num_branches, max_batch=max_batch)
    finally:
        cache_logger.setLevel(level)


def dit_kv_spec(dit: DiTConfig, dtype: torch.dtype) -> KVSpec:
    """What a DreamZero DiT needs from the paged KV cache (the policy's and the memory plan's)."""
    return KVSpec(
        num_layers=dit.num_layers,
        num_heads=dit.num_heads,
        head_dim=dit.head_dim,
        page_size=dit.frame_seqlen,  # one page = one latent frame
        window_pages=dit.local_attn_size,
        max_new_pages=dit.num_frame_per_block,
        max_extra_tokens=dit.action_register_length,
        cross_text_tokens=dit.text_len,
        cross_image_tokens=dit.num_image_tokens if dit.has_image_context else 0,
        dtype=dtype,
    )


# ------------------------------------------------------------------------------ activations


def activation_bytes(geometry: ModelGeometry, dtype: torch.dtype) -> dict[str, int]:
    """Estimated peak bytes of the tensors each component's largest call keeps alive at once.

    * DiT, one denoise forward (the largest: ``num_frame_per_block`` latent frames + the action
      register, L tokens): across layers x, e (L x dim) and the per-token modulation (6 L x dim);
      inside a block its modulation (6 L x dim) plus the larger of self-attention (norms, q, k, v,
      output: 8 L x dim; RoPE in float32: 3 L x dim x 4 bytes; the visible window's K/V gathered
      by the sdpa backend: 2 x block-table tokens x dim) and the FFN (2 L x ffn_dim + 2 L x dim).
    * VAE, one causal chunk at the first (full-resolution) level: 7 tensors (9 for the Wan2.2 VAE)
      of channels x 6 frames x H x W in float32, measured (an upper bound in bf16, where only the
      norms under CUDA autocast stay float32), plus the 33-frame input; the decoder (recordings)
      by the same rule with its own first-level channels.
    * Text encoder: text_len tokens through UMT5 (6 d_model + 3 d_ff per token) and its eager
      attention's float32 scores and probabilities (2 x heads x text_len^2).
    * Image encoder: the same for CLIP's tokens, plus the image resized to its input size.
    """
    b = itemsize(dtype)
    dit = geometry.dit
    spec = dit_kv_spec(dit, dtype)
    tokens = dit.num_frame_per_block * dit.frame_seqlen + dit.action_register_length
    dit_bytes = transformer_forward_bytes(tokens, dit.dim, dit.ffn_dim, spec.block_table_width * spec.page_size, b)

    vae = geometry.vae
    h, w = geometry.canvas
    channels = max(vae.get("base_dim", 96), vae.get("decoder_base_dim") or 0)
    vae_bytes = vae_chunk_bytes(vae, h, w, channels) + 3 * geometry.num_frames * h * w * b

    text = geometry.text
    text_bytes = encoder_bytes(dit.text_len, text["d_model"], text["d_ff"], text["num_heads"], b)

    image = geometry.image
    m = 1 + (image["image_size"] // image["patch_size"]) ** 2
    image_bytes = encoder_bytes(m, image["hidden_size"], image["intermediate_size"], image["num_attention_heads"], b)
    image_bytes += 3 * image["image_size"] ** 2 * 4 + 3 * h * w * b  # the resized image; the newest frame
    return {"dit": dit_bytes, "vae": vae_bytes, "text_encoder": text_bytes, "image_encoder": image_bytes}


# ------------------------------------------------------------------------------ fixes


def _text_on_cpu(s: PlanSettings) -> PlanSettings | None:
    return replace(s, text_encoder_device="cpu") if s.device_of("text_encoder").startswith("cuda") else None


def _image_on_cpu(s: PlanSettings) -> PlanSettings | None:
    return replace(s, image_encoder_device="cpu") if s.device_of("image_encoder").startswith("cuda") else None


def _cfg_parallel(s: PlanSettings) -> PlanSettings | None:
    return replace(s, cfg_parallel_size=2, branches=1) if s.cfg_parallel_size == 1 and s.branches == 2 else None


def _one_session(s: PlanSettings) -> PlanSettings | None:
    return replace(s, max_sessions=1) if s.max_sessions > 1 else None


# Settings a plan that does not fit may suggest, tried alone, then in pairs, ...; None: not applicable.
REMEDIES: tuple[tuple[str, Callable[[PlanSettings], PlanSettings | None]], ...] = (
    ("policy.text_encoder_device=cpu", _text_on_cpu),
    ("policy.image_encoder_device=cpu", _image_on_cpu),
    ("engine.cfg_parallel_size=2 with engine.devices=[cuda:0,cuda:1]", _cfg_parallel),  # a second GPU, one CFG branch on each
    ("engine.max_sessions=1", _one_session),
)


def suggest_fix(plan: MemoryPlan) -> str:
    """What makes the plan fit: a smaller KV budget if the weights and one session's pages fit,
    else the fewest placement settings (every alternative of that size), else a larger GPU.
    A second GPU for CFG-parallel is assumed to have what this one has free."""
    budget = _budget_fix(plan)
    if budget:
        return f"set {budget}"
    for count in range(1, len(REMEDIES) + 1):
        found = []
        for combo in itertools.combinations(REMEDIES, count):
            candidate: PlanSettings | None = plan.settings
            for _, apply in combo:
                candidate = apply(candidate) if candidate is not None else None
            if candidate is None:
                continue
            trial = plan_memory(plan.geometry, candidate, plan.free)
            if _fits_with_floor(trial):
                found.append(_join([name for name, _ in combo] + [b for b in (_budget_fix(trial),) if b]))
        if found:
            return "set " + (" or " if count == 1 else "; or ").join(found[:2])
    smallest = plan_memory(plan.geometry, _with_every_remedy(plan.settings), plan.free)
    worst = max(smallest.devices, key=lambda d: d.total - smallest.free.get(d.device, 0))
    return (
        f"even with every placement option it needs {_floor_total(worst) / GiB:.1f} GiB on {worst.device}: "
        "use a device with more memory (docs/performance.md lists what fits where)"
    )


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _floor_total(d: DevicePlan) -> int:
    """The device's need with the KV pool at the engine's floor (one session's pages)."""
    if d.kv is None:
        return d.total
    floor = replace(d.kv, pages=d.kv.session_pages)
    return d.total - d.kv.pool_bytes + floor.pool_bytes


def _fits_with_floor(plan: MemoryPlan) -> bool:
    return all(d.device in plan.free and _floor_total(d) <= plan.free[d.device] for d in plan.devices)


def _budget_fix(plan: MemoryPlan) -> str | None:
    """The KV setting that makes the engine device fit, when only the pool's size is the problem."""
    settings = plan.settings
    engine = plan.device(settings.engine_device)
    free = plan.free.get(engine.device)
    if engine.kv is None or free is None or engine.total <= free or _floor_total(engine) > free:
        return None
    if settings.kv_budget_gib is not None:
        key, current = "kv_budget_gib", settings.kv_budget_gib
    else:
        key, current = "kv_memory_fraction", settings.kv_memory_fraction

    def fits(steps: int) -> bool:
        trial = plan_memory(plan.geometry, replace(settings, **{key: steps / 100}), plan.free)
        return trial.device(engine.device).total <= free

    # The largest value (in hundredths, at least 0.01: the floor fits) that fits: the need grows with it.
    low, high = 1, max(1, round(current * 100))
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return f"engine.{key}={low / 100:g}"


def _with_every_remedy(settings: PlanSettings) -> PlanSettings:
    for _, apply in REMEDIES:
        settings = apply(settings) or settings
    return settings


def _breakdown(d: DevicePlan) -> str:
    parts = [f"weights {sum(d.weights.values()) / GiB:.1f}"]
    if d.kv is not None:
        parts.append(f"KV {d.kv.pool_bytes / GiB:.1f}")
    parts.append(f"activations {d.activations / GiB:.1f}")
    if d.reserve:
        parts.append(f"unmeasured reserve {d.reserve / GiB:.1f}")
    each = f" for each of {d.processes} CFG ranks" if d.processes > 1 else ""
    return " + ".join(parts) + " GiB" + each


# ------------------------------------------------------------------------------ devices


def check_devices_exist(devices: Sequence[str], cuda_count: int) -> None:
    """Placement devices this machine has (the engine's own are checked before workers start)."""
    for device in devices:
        match = re.fullmatch(r"cuda:(\d+)", device)
        if match and int(match[1]) >= cuda_count:
            have = f"{cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
            raise MemoryPlanError(f"{device}: this machine has {have}; set policy.text_encoder_device / image_encoder_device to cpu or engine")


def _config_of(module: nn.Module) -> Any:
    inner = getattr(module, "model", module)
    return inner.config


def _size(value: int) -> str:
    return f"{value / GiB:.2f} GiB" if value >= 0.1 * GiB else f"{value / 2**20:.1f} MiB"


def _count(value: int) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e8 else f"{value / 1e6:.2f} M"


def check_plan(geometry: ModelGeometry, config: Any, options: RuntimeOptions, device: torch.device) -> None:
    """Log this process's memory plan and refuse (StartRefused, one line) if a device cannot hold its part.
    ``config`` is the policy's :class:`~ardiff_policies.dreamzero.config.DreamZeroConfig`."""
    if device.type == "cuda" and device.index is None:  # "cuda": this process's current GPU, named like the placements
        device = torch.device("cuda", torch.cuda.current_device())
    settings = PlanSettings(
        engine_device=str(device),
        dtype=getattr(torch, options.dtype),
        text_encoder_device=config.text_encoder_device,
        image_encoder_device=config.image_encoder_device,
        branches=len(options.guidance.local_branches) if config.cfg_scale != 1.0 else 1,
        cfg_parallel_size=2 if options.guidance.is_parallel else 1,
        max_sessions=options.max_sessions,
        kv_budget_gib=options.kv_budget_gib,
        kv_memory_fraction=options.kv_memory_fraction,
        max_batch=options.max_batch,
        host_processes=2 if options.guidance.is_parallel else 1,
    )
    used = {settings.device_of(c) for c in COMPONENTS}
    check_devices_exist(sorted(used), torch.cuda.device_count() if any(d.startswith("cuda") for d in used) else 0)
    free = {d: free_bytes(d) for d in used | {"cpu"}}
    plan = plan_memory(geometry, settings, free)
    if options.guidance.rank > 0:  # the ranks start at once: rank 0 checks the host for both (each seeing it all free would not)
        plan = replace(plan, unchecked=frozenset({"cpu"}))
    logger.info("%s", plan.describe())
    plan.check()
