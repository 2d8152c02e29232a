"""The task model: the tiny DreamZero trained on a synthetic task (``ardiff_sim.tiny_task``), so continuations can be
measured on a CPU.

The random tiny checkpoint's actions mean nothing; this one's follow smooth trajectories that depend on the
observation and on the motion under way. The checkpoint is builtin:tiny's architecture at DiT width 128 with a
256-wide action head (``TASK_DIT``: builtin:tiny's is too narrow to denoise cleanly), its DiT trained with
DreamZero's flow-matching action loss (velocity ``noise - actions``, shift-5 noise levels). Half the batches use
per-token action noise with a clean (timestep 0) prefix of random length, upstream's decoupled action noise, so
``policy.continuation=clean_prefix`` has something to stand on. The video, text and image conditioning are the
real ones of the tiny encoders for rendered views of the task (the actions do not depend on them; the
cross-attention K/V are projected once, as the server caches them); the training forward attends over the
chunk without the KV window the server adds, so the model sees more context when served.

Deterministic (fixed seeds, data from numpy, one thread), cached like the tiny checkpoint
(``~/.cache/ardiff-server/tiny-task-dreamzero-*``; ``ARDIFF_CACHE_DIR`` overrides), never committed. 600 steps
took ~10 min on the 2 shared CPU cores (~0.75-2 s a step, by the other jobs' load)::

    .venv/bin/python scripts/train_tiny_task.py                # train once, print the cached directory
    .venv/bin/python scripts/train_tiny_task.py --steps 200 --out /tmp/task   # a short run anywhere
    ardiff-serve --set policy.checkpoint=<that directory> --set policy.view_size=[48,80]

In code (the benches): ``ensure_task_checkpoint(steps)`` -> the cached checkpoint, ``task_policy(model, checkpoint,
continuation)`` -> a ``DreamZeroPolicy`` on it with a one-session KV cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ardiff_kv import CrossKV, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.dreamzero.naming import DIT_PREFIX
from ardiff_policies.dreamzero.policy import DreamZeroPolicy
from ardiff_policies.dreamzero.tiny import (
    TINY_DIT,
    TINY_IMAGE_ENCODER,
    TINY_TEXT_ENCODER,
    TINY_VAE,
    default_cache_dir,
    droid_metadata,
    write_checkpoint,
)
from ardiff_policies.observation import RobotObservation
from ardiff_sim import tiny_task
from ardiff_sim.tiny_task import VIEW

VERSION = 3  # 2: its own DiT geometry; 3: episodes turn either way (tiny_task.random_direction)
# builtin:tiny's DiT at twice its width and with a wider action head. builtin:tiny's state encoder / action decoder
# MLPs (hidden_size 32) squeeze 32 action columns through 32 ReLU units, too narrow to pass the noise through at the
# gain the velocity needs; at width 64 the chunks stay jagged after minutes of training (docs/design-notes.md).
TASK_DIT = dataclasses.replace(TINY_DIT, dim=128, ffn_dim=256, hidden_size=256)
DEFAULT_STEPS = 600
BENCH_STEPS = 1500  # the benches' model (scripts/bench_async.py, scripts/bench_fleet.py): trained longer, cached apart
BATCH = 16
LR = 2e-3
SHIFT = 5.0


def cache_dir(steps: int) -> Path:
    spec = json.dumps([VERSION, steps, BATCH, LR, TASK_DIT.to_dict(), tiny_task.SPEEDS, tiny_task.RADIUS, tiny_task.RELAX])
    digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
    return default_cache_dir().parent / f"tiny-task-dreamzero-v{VERSION}-{digest}"


def ensure_task_checkpoint(steps: int = DEFAULT_STEPS, out: Path | None = None, log=lambda line: print(line, flush=True)) -> Path:
    target = out or cache_dir(steps)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_task_checkpoint(staging)
        train(staging, steps, log)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_task_checkpoint(out: Path) -> Path:
    """The untrained task checkpoint: TASK_DIT's random weights, the tiny encoders, the task's statistics."""
    metadata = droid_metadata()
    metadata["oxe_droid"]["statistics"] = tiny_task.statistics()
    return write_checkpoint(out, TASK_DIT, TINY_TEXT_ENCODER, TINY_IMAGE_ENCODER, TINY_VAE, seed=0, metadata=metadata)


def conditioning(policy: DreamZeroPolicy, rng: np.random.Generator, views: int = 2) -> list[dict[str, torch.Tensor]]:
    """Text, CLIP and ``ys`` conditioning of real sessions on rendered views of the task (one per view)."""
    out = []
    for i in range(views):
        image = tiny_task.render(tiny_task.random_state(rng), VIEW)[None]
        obs = RobotObservation(
            exterior_left=image,
            exterior_right=image,
            wrist=image,
            joint_position=np.zeros(7, np.float32),
            gripper_position=np.zeros(1, np.float32),
            prompt=tiny_task.PROMPT,
        )
        session = policy.start_session(f"c{i}", _KV())
        policy._advance_session(session, obs)
        video = policy.inputs.video_tensor(session)
        clip = policy.model.image_encoder(video[:, :, -1]).to(policy.dtype)
        ys, _ = policy.inputs.image_conditioning(video[:, :, -1:])
        projected = policy.dit.project_cross_kv(policy.inputs.encode_text(session.prompt), clip)
        out.append({"cross": [CrossKV(*text, *image) for text, image in projected], "ys": ys})
    return out


class _KV:  # the conditioning pass never touches the KV cache
    def restart_window(self, keep_cross_text: bool) -> None:
        pass


def batch(policy: DreamZeroPolicy, rng: np.random.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalized state (B, 1, 64), normalized relative actions (B, H, 32), clean-prefix length per sample)."""
    head = policy.action_head_config
    joints = tiny_task.random_state(rng, size)
    grippers = rng.uniform(0.1, 0.9, size)
    chunks = tiny_task.expert_chunk(joints, tiny_task.random_direction(rng, size))
    chunks[..., :7] -= joints[:, None]  # relative joints
    stats = policy.action_stats
    actions = np.zeros((size, tiny_task.HORIZON, head.max_action_dim))
    actions[..., :8] = 2.0 * (chunks - stats.q01) / (stats.q99 - stats.q01) - 1.0
    states = np.stack([policy._model_state(np.concatenate([j, [g]])) for j, g in zip(joints, grippers, strict=True)])
    prefix = np.where(rng.random(size) < 0.5, rng.integers(0, tiny_task.HORIZON, size), 0)
    return (
        torch.tensor(np.array(states), dtype=torch.float32)[:, None],
        torch.tensor(np.array(actions), dtype=torch.float32),
        torch.from_numpy(prefix),
    )


def action_loss(dit: torch.nn.Module, policy: DreamZeroPolicy, cond: dict, rng: np.random.Generator, size: int) -> torch.Tensor:
    """DreamZero's flow-matching action loss on one fresh batch of the task (random window position, video noise, prefix)."""
    state, clean, prefix = batch(policy, rng, size)
    cfg, (lh, lw) = dit.config, cond["ys"].shape[-2:]
    nfpb = cfg.num_frame_per_block
    start = int(rng.choice([1, 3, 5, 7]))  # the window positions a denoise call runs at
    sigma = torch.rand(size, 1)
    sigma = SHIFT * sigma / (1 + (SHIFT - 1) * sigma)
    sigma_tokens = sigma.expand(-1, tiny_task.HORIZON).clone()
    sigma_tokens[torch.arange(tiny_task.HORIZON)[None] < prefix[:, None]] = 0.0  # clean prefix tokens
    noise = torch.randn_like(clean)
    noisy = (1 - sigma_tokens[..., None]) * clean + sigma_tokens[..., None] * noise
    video_sigma = torch.rand(size, 1)
    latents = torch.randn(size, cfg.out_dim, nfpb, lh, lw)
    ys = cond["ys"][:, :, start : start + nfpb].expand(size, -1, -1, -1, -1)
    _, pred = dit(
        latents,
        (video_sigma * 1000).long().expand(-1, nfpb),
        current_start_frame=start,
        self_kv=None,
        y=ys,
        cross_kv=[(layer,) * size for layer in cond["cross"]],
        action=noisy,
        timestep_action=(sigma_tokens * 1000).long(),
        state=state,
    )
    # Every column (the padding ones learn to flow to 0, so they stay in distribution as the DiT's inputs); clean prefix
    # tokens carry no loss.
    weight = (sigma_tokens > 0).float()[..., None]
    return (((pred - (noise - clean)) ** 2) * weight).sum() / (weight.sum() * clean.shape[-1])


def _single_thread(fn):
    # One thread: the same floating-point reductions on every machine (bit-reproducible weights), and no
    # OpenMP spin-waiting on a shared 2-core runner.
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


def _load(checkpoint: Path) -> tuple[DreamZeroPolicy, list[dict], np.random.Generator]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = DreamZeroModel.load(checkpoint)
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint=str(checkpoint), view_size=VIEW), RuntimeOptions(), model=model)
    with torch.no_grad():
        conds = conditioning(policy, rng)
    return policy, conds, rng


@_single_thread
def held_out_loss(checkpoint: Path, batches: int = 4, size: int = 16, seed: int = 12345) -> float:
    """The action loss of ``checkpoint`` on fixed batches the training never draws (another seed)."""
    policy, conds, _ = _load(checkpoint)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        return float(np.mean([action_loss(policy.dit, policy, conds[i % len(conds)], rng, size).item() for i in range(batches)]))


@_single_thread
def train(checkpoint: Path, steps: int, log=print, batch_size: int = BATCH) -> None:
    policy, conds, rng = _load(checkpoint)
    dit = policy.dit
    dit.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(dit.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=steps, pct_start=0.1)
    started, recent = time.perf_counter(), []
    for step in range(steps):
        loss = action_loss(dit, policy, conds[step % len(conds)], rng, batch_size)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"step {step + 1}/{steps}: loss {np.mean(recent):.4f} ({time.perf_counter() - started:.0f} s)")
            recent = []
    dit.eval().requires_grad_(False)
    shard = checkpoint / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    trained = {DIT_PREFIX + name: value.detach().contiguous() for name, value in dit.state_dict().items()}
    missing = [name for name in tensors if name not in trained]
    if missing:
        raise RuntimeError(f"the DiT has no tensor for {missing[:3]}")
    save_file({name: trained[name].to(tensors[name].dtype) for name in tensors}, shard, metadata={"format": "pt"})


def task_policy(model: DreamZeroModel, checkpoint: Path, continuation: str) -> tuple[DreamZeroPolicy, PagedKVCache]:
    """A policy serving the task model with ``policy.continuation=continuation``, and a KV cache for one session."""
    policy = DreamZeroPolicy(DreamZeroConfig(checkpoint=str(checkpoint), view_size=VIEW, continuation=continuation), RuntimeOptions(), model=model)
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=len(policy.branches) * spec.pages_per_branch + 1, max_sessions=1, branches=policy.branches)
    return policy, cache
