"""A failed batched LingBot-VA call is retried member by member (``episode.py``, ``ardiff_policies.batch_retry.run_batched``): every member is put
back as it was (KV pages and lengths of both CFG branches, VAE stream caches, noise generator, frame position) and
run alone; only the member that fails alone fails (the engine ends it, its pages back in the pool), the others get
exactly what they get alone, in that call and every later one."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ardiff_policies.episode import EpisodeCall
from ardiff_policies.observation import RobotObservation
from ardiff_server.config import load_config
from ardiff_server.engine.builder import build_engine
from ardiff_server.engine.messages import ErrorKind, ErrorReply, Infer

ATOL = 1e-5
ROLES = ("a", "b", "bad")
CALLS = 8  # 4 chunks of infer + compute_kv_cache: the tiny window (2 chunks) slides twice


@pytest.fixture(scope="module")
def engine():
    config = load_config("tiny_lingbot_va", overrides=["engine.warmup=false", "engine.max_batch=4"])
    engine = build_engine(config)
    assert len(engine.policy.branches) == 2  # both CFG branches' caches are written and rolled back
    yield engine
    engine.close()


def observe(engine, role: str, call: int, last_actions: np.ndarray | None) -> RobotObservation:
    """The RoboTwin client's loop: infer (one frame), compute_kv_cache (the key frames and the executed actions)."""
    policy = engine.policy
    rng = np.random.default_rng([ROLES.index(role), call])
    frames = 1 if call % 2 == 0 else (4 if call == 1 else 8)
    cameras = {n: rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for n, (h, w) in zip(policy.cameras, policy.schema.resolutions)}
    if call % 2 == 0:
        return RobotObservation(cameras, {}, f"task {role}", EpisodeCall("infer", video_guidance_scale=3.0, action_guidance_scale=2.0))
    executed = last_actions.T.reshape(policy.channels, policy.frames, policy.per_frame)
    return RobotObservation(cameras, {}, f"task {role}", EpisodeCall("compute_kv_cache", executed_actions=executed))


def episode(engine, members: list[tuple[str, str]], *, fail_at: int | None = None, fail=None, monkeypatch=None) -> dict:
    """Every member's calls, the members of a round in one batch; ``fail`` patched in for round ``fail_at``."""
    out = {role: [] for _, role in members}
    last: dict[str, np.ndarray] = {}
    ids = iter(range(100_000))
    alive = list(members)
    for call in range(CALLS):
        requests = [Infer(next(ids), sid, observe(engine, role, call, last.get(role))) for sid, role in alive]
        if call == fail_at:
            monkeypatch.setattr(engine.policy.episodes, "_forward", fail)
        replies = {r.request_id: r for r in engine.run(requests)}
        if call == fail_at:
            monkeypatch.undo()
        for request, (sid, role) in zip(requests, list(alive)):
            reply = replies[request.request_id]
            out[role].append(reply)
            if isinstance(reply, ErrorReply):
                alive.remove((sid, role))
            elif len(reply.actions):
                last[role] = reply.actions
    return out


@pytest.fixture(scope="module")
def alone(engine) -> dict:
    out = {}
    for role in ("a", "b"):
        out.update(episode(engine, [(f"alone-{role}", role)]))
        engine.end(f"alone-{role}", "test")
    return out


@pytest.mark.parametrize(
    ("fail_at", "mode"),
    [
        (0, "infer"),  # a first infer: the observation went through the VAE streams, the generator drew
        (6, "infer"),  # a later infer: predicted pages written, committed pages evicted to fit the window
        (5, "compute_kv_cache"),  # a commit: the prediction dropped, the frames' video pages committed
    ],
)
def test_one_failing_member_costs_the_others_nothing(engine, alone, monkeypatch, caplog, fail_at, mode):
    policy = engine.policy.episodes
    original = policy._forward

    def fail(sessions, x, timesteps, grids, *, action_mode, update, text_kv):
        # the batch's last forward of this call, after everything else it writes: the action chunk's pages
        if action_mode and update == (1 if mode == "infer" else 2) and any(s.session_id == "batch-bad" for s in sessions):
            raise RuntimeError("injected: this member's forward fails")
        return original(sessions, x, timesteps, grids, action_mode=action_mode, update=update, text_kv=text_kv)

    pool = engine.cache.pool
    members = [(f"batch-{role}", role) for role in ROLES]
    with caplog.at_level(logging.WARNING, logger="ardiff_policies.lingbot_va.episode"):
        out = episode(engine, members, fail_at=fail_at, fail=fail, monkeypatch=monkeypatch)
    assert "retrying each alone" in caplog.text  # the batch was retried, not run one by one for want of pages
    bad = out["bad"][fail_at]
    assert isinstance(bad, ErrorReply) and bad.kind is ErrorKind.POLICY and "injected" in bad.message
    assert len(out["bad"]) == fail_at + 1 and "batch-bad" not in engine.sessions  # ended
    for role in ("a", "b"):
        assert len(out[role]) == CALLS
        for got, want in zip(out[role], alone[role], strict=True):
            assert not isinstance(got, ErrorReply), got.message
            assert got.actions.shape == want.actions.shape
            np.testing.assert_allclose(got.actions, want.actions, atol=ATOL, rtol=0)
        assert out[role][fail_at].batch_size == 3 and out[role][-1].batch_size == 2
    held = sum(engine.sessions[sid].kv.pages_held for sid in ("batch-a", "batch-b"))
    assert pool.num_free == pool.capacity - held  # the failed member's pages (and everything set aside) are back
    engine.end("batch-a", "test")
    engine.end("batch-b", "test")
    assert pool.num_free == pool.capacity


def test_without_spare_pages_a_batch_runs_one_by_one_and_equals_alone(engine, alone, monkeypatch, caplog):
    """A pool too full to set pages aside runs the members one after another (no undo needed), with a warning."""
    episodes = engine.policy.episodes
    monkeypatch.setattr(episodes, "_warned_headroom", False)
    monkeypatch.setattr(type(engine.cache.pool), "num_free", property(lambda pool: 0))
    with caplog.at_level(logging.WARNING, logger="ardiff_policies.lingbot_va.episode"):
        out = episode(engine, [("tight-a", "a"), ("tight-b", "b")])
    monkeypatch.undo()
    assert "one session at a time" in caplog.text
    for role in ("a", "b"):
        for got, want in zip(out[role], alone[role], strict=True):
            np.testing.assert_allclose(got.actions, want.actions, atol=ATOL, rtol=0)
    engine.end("tight-a", "test")
    engine.end("tight-b", "test")
