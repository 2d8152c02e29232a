"""Zero-WAM's served episode logic (policies/lingbot_va/zero_wam_episode.py) against upstream's own server.

``tests/reference_data/upstream_zero_wam_tiny.*``'s ``serving.*`` entries are what upstream's ``VA_Server`` returned on
the tiny checkpoint over its RoboTwin client's call order (scripts/record_upstream_zero_wam.py): two episodes of four
chunks, episode 0 in-context guidance 5 with the empty text as target (``video_guidance_scale`` -1), episode 1 text
guidance 5 (``icl_guidance_scale`` 1) with its demonstration pinned all the same. Here ``ZeroWAMEpisodes`` is driven in
that order with exactly the recorded inputs (each checked against the sha256 the JSON holds): the checkpoint, the
embodiment, the two demonstrations, the prompts and scales, the seed upstream's global generator got right after each
reset, the first observation and every chunk's key frames. Every chunk's actions and the first encoded observation
must equal upstream's within 1e-5 (float32; upstream's bf16 cast inside its attention neutralised by the recorder, the
only adaptation: docs/zero-wam.md "Parity"), alone and through the engine's policy batched with another robot.

Nothing of docs/zero-wam.md "Where this server differs" needs neutralising: the per-session seed is upstream's global
seed here, the demonstrations are read by id from a root as upstream reads ``ICL_LATENT_ROOT``, and the bounds (frames
pinned, infers before a commit, the window) are not reached.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ardiff_kv import PagedKVCache
from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.lingbot_va.episode_io import LATENT_CHANNELS
from ardiff_policies.lingbot_va.zero_wam_config import ZeroWAMPolicyConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_episode import ZeroWAMEpisodes
from ardiff_policies.lingbot_va.zero_wam_guidance import GuidanceMode
from ardiff_policies.lingbot_va.zero_wam_policy import ZeroWAMPolicy
from ardiff_policies.lingbot_va.zero_wam_tiny import TINY_ZERO_WAM, ensure_tiny_zero_wam_checkpoint
from ardiff_policies.observation import RobotObservation
from ardiff_policies.wan.tiny import tree_digest
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import Infer, InferReply
from ardiff_server.wire.lingbot_va import action_reply
from tests.helpers.scripts import load_script
from tests.helpers.zero_wam import ATOL, reference_or_skip

RECORD = load_script("record_upstream_zero_wam")  # its embodiment, demonstrations and frames, drawn as recorded
EMBODIMENT = RECORD.tiny_embodiment()


@pytest.fixture(scope="module")
def reference():
    meta, tensors = reference_or_skip()
    serving = meta["serving"]
    assert meta["checkpoint_sha256"] == tree_digest(ensure_tiny_zero_wam_checkpoint()), (
        "the tiny Zero-WAM changed: rerun scripts/record_upstream_zero_wam.py"
    )
    assert json.loads(json.dumps(dataclasses.asdict(EMBODIMENT))) == serving["embodiment"], "the recorder's embodiment changed: record again"
    assert serving["server_config"] == {"icl_rope_h": 24, "use_icl_model": True, "empty_text_emb_path": None, "enable_text": True}
    assert serving["episodes"] == json.loads(json.dumps(list(RECORD.EPISODES))) and serving["camera_size"] == list(RECORD.CAMERA_SIZE)
    return meta, tensors


@pytest.fixture(scope="module")
def demonstration_root(reference, tmp_path_factory) -> Path:
    """Upstream's ``ICL_LATENT_ROOT`` as recorded: each episode's ``<id>.pth`` written by the recorder's own function,
    its latent and text checked against the sha256 the JSON holds."""
    meta, _ = reference
    root = tmp_path_factory.mktemp("demonstrations")
    for episode in RECORD.EPISODES:
        item = RECORD.demonstration(episode["demo"], LATENT_CHANNELS, TINY_ZERO_WAM.base.text_dim)
        path = root / f"{episode['demo_id']}.pth"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(item, path)
        # the tensors upstream read (the file's own bytes, also recorded, may differ with torch's serialisation)
        recorded = {k: v for k, v in meta["demonstrations"]["sha256"][episode["demo_id"]].items() if k != "file"}
        written = {k: v for k, v in RECORD.demo_record(item, path).items() if k != "file"}
        assert written == recorded and "latent" in written, f"demonstration {episode['demo_id']!r} is not the recorded one"
    return root


@pytest.fixture(scope="module")
def policy(demonstration_root) -> ZeroWAMEpisodes:
    """float32 on the CPU; demonstrations of the recorded 4x6 latent frames, up to the longest recorded (3 frames)."""
    geometry = DemonstrationGeometry(latent_size=(4, 6), max_frames=max(e["demo"]["frames"] for e in RECORD.EPISODES))
    assert all((e["demo"]["height"], e["demo"]["width"]) == geometry.latent_size for e in RECORD.EPISODES)
    return ZeroWAMEpisodes.load(ensure_tiny_zero_wam_checkpoint(), EMBODIMENT, demonstrations=geometry, demonstration_root=demonstration_root)


def _messages(meta: dict, episode: int, kind: str) -> list[dict]:
    return [m for m in meta["serving"]["messages"] if m["episode"] == episode and m["message"] == kind]


@dataclasses.dataclass
class Recorded:
    """One recorded episode's inputs, each checked against the JSON."""

    prompt: str
    start: EpisodeStart
    in_context: bool  # upstream's use_icl_cfg after its reset
    first: dict[str, np.ndarray]
    key_frames: list[list[dict[str, np.ndarray]]]  # per chunk

    @classmethod
    def of(cls, meta: dict, n: int) -> Recorded:
        episode = RECORD.EPISODES[n]
        (reset,) = _messages(meta, n, "reset")
        start = EpisodeStart(reset["use_icl"], reset["icl_demo_id"], reset["video_guidance_scale"], reset["icl_guidance_scale"])
        assert (reset["prompt"], start.demonstration_id) == (episode["prompt"], episode["demo_id"])
        first = RECORD.record_upstream_lingbot_va.observation(EMBODIMENT.cameras, episode["frame_seed"], RECORD.CAMERA_SIZE)
        infers, commits = _messages(meta, n, "infer"), _messages(meta, n, "compute_kv_cache")
        assert len(infers) == len(commits) == episode["chunks"]
        keys = []
        for chunk, (infer, commit) in enumerate(zip(infers, commits)):
            assert infer["obs_sha256"] == RECORD.frame_hashes([first]), f"episode {n} chunk {chunk}: the first observation is not the recorded one"
            assert infer["action_shape"] == [len(EMBODIMENT.used_action_channel_ids), EMBODIMENT.frame_chunk_size, EMBODIMENT.action_per_frame]
            frames = RECORD.frames(EMBODIMENT.cameras, episode, chunk, RECORD.FRAMES_PER_LATENT * (EMBODIMENT.frame_chunk_size - (chunk == 0)))
            assert commit["obs_sha256"] == RECORD.frame_hashes(frames), f"episode {n} chunk {chunk}: the key frames are not the recorded ones"
            keys.append(frames)
        return cls(episode["prompt"], start, reset["use_icl_cfg"], first, keys)


def _max_error(actions: np.ndarray, expected: torch.Tensor) -> float:
    assert actions.shape == tuple(expected.shape) and actions.dtype == np.float32
    return float(np.abs(actions - expected.numpy()).max())


def test_the_episode_logic_serves_upstreams_actions(reference, policy):
    """Upstream's client's order with one session: reset (seed 0 after it, as recorded), then four times an infer with
    the first observation and a compute_kv_cache with the key frames; the second episode on the same session."""
    meta, tensors = reference
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=spec.reservation(2) + 1, max_sessions=1, attention_backend="sdpa")
    session = policy.start_session("robot", cache.open_session("robot"))
    errors: dict[str, float] = {}
    for n in range(len(RECORD.EPISODES)):
        recorded = Recorded.of(meta, n)
        policy.begin(session, recorded.prompt, recorded.start, seed=meta["serving"]["seed"])
        assert (session.plan.mode is GuidanceMode.IN_CONTEXT) == recorded.in_context and session.plan.demonstration
        for chunk, frames in enumerate(recorded.key_frames):
            actions = policy.infer(session, recorded.first)
            errors[f"ep{n}.actions.{chunk}"] = _max_error(actions, tensors[f"serving.ep{n}.actions.{chunk}"])
            if chunk == 0:
                errors[f"ep{n}.first_latent"] = (session.init_latent - tensors[f"serving.ep{n}.first_latent"]).abs().max().item()
                # upstream's _infer_icl: the cached history has the first chunk's frame 0 zeroed, the reply keeps it
                assert session.action_history[:, :, 0].abs().max() == 0 and np.abs(actions[:, 0]).max() > 1.0
            policy.compute_kv_cache(session, frames)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ATOL, f"serving.{worst}: max abs error {errors[worst]:.3g} vs upstream's server ({errors})"


def _observation(prompt: str, start: EpisodeStart, kind: str, frames: list[dict[str, np.ndarray]] | None = None) -> RobotObservation:
    """What the RoboTwin route hands the engine: the reset's start repeated on every call (frontend/lingbot_va.py)."""
    cameras = {}
    if frames:
        cameras = {camera.removeprefix("observation.images."): np.stack([f[camera] for f in frames]) for camera in EMBODIMENT.cameras}
    return RobotObservation(cameras=cameras, states={}, prompt=prompt, episode=EpisodeCall(kind, start=start))


def _step(engine: SessionEngine, kind: str, *sessions: tuple[Recorded, list | None]) -> InferReply:
    """One engine step of both robots ("robot", "other"), batched; the robot's reply."""
    requests = [
        Infer(i, name, _observation(r.prompt, r.start, kind, frames)) for i, (name, (r, frames)) in enumerate(zip(("robot", "other"), sessions))
    ]
    replies = engine.run(requests)
    assert all(isinstance(r, InferReply) for r in replies), replies
    assert {r.batch_size for r in replies} == {2}
    return replies[0]


def test_batched_with_another_robot_through_the_engine_policy_upstreams_actions(reference, policy):
    """The same episodes through the engine's policy (``ZeroWAMPolicy``) with a second robot in every step: the other
    episode's prompt, demonstration and guidance on other frames, so each batch mixes in-context and text guidance (one
    batch of both sessions' halves), and the robot's actions are still upstream's within 1e-5."""
    meta, tensors = reference
    serving = ZeroWAMPolicy(policy, ZeroWAMPolicyConfig(seed=meta["serving"]["seed"]), "builtin:tiny")
    assert serving.cameras == tuple(c.removeprefix("observation.images.") for c in EMBODIMENT.cameras)
    spec = policy.kv_spec()
    pages = 2 * spec.reservation(2) + PagedKVCache.undo_headroom(spec, 2, 2) + 1
    cache = PagedKVCache(spec, num_pages=pages, max_sessions=2, branches=serving.branches, attention_backend="sdpa", max_batch=2)
    engine = SessionEngine(serving, cache, max_sessions=2, max_batch=2)
    errors: dict[str, float] = {}
    for n in range(len(RECORD.EPISODES)):
        robot, other = Recorded.of(meta, n), Recorded.of(meta, 1 - n)
        other_first = RECORD.record_upstream_lingbot_va.observation(EMBODIMENT.cameras, 77 + n, RECORD.CAMERA_SIZE)
        for session_id in ("robot", "other"):
            engine.end(session_id, "reset")  # the RoboTwin route's reset: the session ends, the episode begins anew
        _step(engine, "reset", (robot, None), (other, None))
        for chunk, frames in enumerate(robot.key_frames):
            reply = _step(engine, "infer", (robot, [robot.first]), (other, [other_first]))
            actions = action_reply(reply.actions, len(EMBODIMENT.used_action_channel_ids), EMBODIMENT.frame_chunk_size, EMBODIMENT.action_per_frame)
            errors[f"ep{n}.actions.{chunk}"] = _max_error(actions, tensors[f"serving.ep{n}.actions.{chunk}"])
            other_frames = RECORD.frames(EMBODIMENT.cameras, {"frame_seed": 90 + n}, chunk, len(frames))
            _step(engine, "compute_kv_cache", (robot, frames), (other, other_frames))
    engine.close()
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ATOL, f"serving.{worst}: max abs error {errors[worst]:.3g} vs upstream's server, batched ({errors})"
