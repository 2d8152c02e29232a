"""LingBot-VA continues its chunks (``policies/lingbot_va/episode.py``): an ``infer`` asked while the last chunk
executes is the model's next chunk over the last one's predicted (provisional) K/V, its first ``delay`` actions the
last chunk's ``[executed, executed + delay)`` exactly; a commit replaces the provisional entries with the real ones;
nothing leaks; a refused or failed call leaves the session as it was; batched equals alone."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_kv import EntryKind
from ardiff_policies.continuation import APPLIED, NO_PREVIOUS_CHUNK, UNKNOWN_CHUNK_ID, Continuation
from ardiff_policies.episode import EpisodeCall
from ardiff_policies.lingbot_va.episode import LingBotVAEpisodes
from ardiff_policies.observation import RobotObservation
from ardiff_server.config import load_config
from ardiff_server.engine.builder import build_engine
from ardiff_server.engine.messages import ErrorKind, ErrorReply, Infer
from tests.helpers.lingbot_va import cameras

ATOL = 1e-5
H = 32  # tiny RoboTwin: 2 latent frames x 16 actions
PROMPT = "stack the cube"


@pytest.fixture(scope="module")
def engine():
    engine = build_engine(load_config("tiny_lingbot_va", overrides=["engine.warmup=false", "engine.max_batch=4"]))
    yield engine
    engine.close()


def infer(engine, frames=1, seed=0, continuation=None) -> RobotObservation:
    return RobotObservation(cameras(engine, frames, seed), {}, PROMPT, EpisodeCall("infer"), continuation=continuation)


def commit(engine, frames: int, seed: int, actions: np.ndarray) -> RobotObservation:
    return RobotObservation(cameras(engine, frames, seed), {}, PROMPT, EpisodeCall("compute_kv_cache", executed_actions=upstream(actions)))


def upstream(actions: np.ndarray) -> np.ndarray:
    """The engine's time-major (H, channels) actions as LingBot-VA's (channels, frames, per frame)."""
    return np.ascontiguousarray(actions.T.reshape(16, 2, 16))


def episode(engine, sid: str) -> list:
    """infer; a continuation of it (its frames not observed yet); the commit of the first chunk; a continuation of
    the second (its stand-in written again over the real frames); the second's commit. Returns each step's result."""
    out = [engine.infer(sid, infer(engine, 1, 1)).result]
    out.append(engine.infer(sid, infer(engine, 1, 2, Continuation(20, 4, chunk_id=1))).result)
    out.append(engine.infer(sid, commit(engine, 4, 3, out[0].actions)).result)
    out.append(engine.infer(sid, infer(engine, 1, 4, Continuation(8, 8, chunk_id=2))).result)
    out.append(engine.infer(sid, commit(engine, 8, 5, out[1].actions)).result)
    return out


def test_frozen_rows_are_the_executing_chunks_and_provisional_pages_are_replaced_then_returned(engine):
    pool = engine.cache.pool
    free = pool.num_free
    first, second, _, third, _ = episode(engine, "frozen")
    assert (first.chunk.chunk_id, first.chunk.frozen, first.chunk.execute_from) == (1, 0, 16)
    assert (second.chunk.chunk_id, second.chunk.frozen, second.chunk.continuation) == (2, 4, APPLIED)
    assert second.chunk.execute_from == 0  # a continued chunk is never the episode's first
    np.testing.assert_array_equal(second.actions[:4], first.actions[20:24])  # exactly what the robot executes
    assert np.abs(second.actions[4:] - first.actions[24:].mean(0)).max() > 0  # the rest is the model's
    assert (third.chunk.chunk_id, third.chunk.frozen) == (3, 8)
    np.testing.assert_array_equal(third.actions[:8], second.actions[8:16])
    session = engine.sessions["frozen"]
    kv = session.policy_state.episode.kv
    assert all(not kv.branch(b).pages(EntryKind.PREDICTION) for b in engine.policy.branches)  # the last commit dropped them
    engine.end("frozen", "test")
    assert pool.num_free == free == pool.capacity


def test_the_stand_in_holds_the_predicted_frames_until_the_commit_replaces_them(engine):
    """While chunk 1 executes, its prediction entries are in the KV beside chunk 2's; the commit drops both and writes
    chunk 1's frames; the continuation of chunk 2 writes chunk 2's prediction again over them."""
    sid = "stand-in"
    branch = engine.policy.branches[0]
    first = engine.infer(sid, infer(engine, 1, 1)).result
    kv = engine.sessions[sid].policy_state.episode.kv
    one_chunk = len(kv.branch(branch).pages(EntryKind.PREDICTION))
    engine.infer(sid, infer(engine, 1, 2, Continuation(20, 4)))
    assert len(kv.branch(branch).pages(EntryKind.PREDICTION)) == 2 * one_chunk  # chunk 1's stand-in and chunk 2's
    engine.infer(sid, commit(engine, 4, 3, first.actions))
    observed = len(kv.branch(branch).pages(EntryKind.OBSERVATION))
    assert observed > 0 and not kv.branch(branch).pages(EntryKind.PREDICTION)
    engine.infer(sid, infer(engine, 1, 4, Continuation(8, 8)))
    assert len(kv.branch(branch).pages(EntryKind.PREDICTION)) == 2 * one_chunk  # chunk 2's again, chunk 3's
    # the tiny window holds two chunks: the stand-in and the new chunk slide the observation out (oldest first)
    window = engine.policy.kv_spec().window_pages
    assert len(kv.branch(branch).pages(EntryKind.OBSERVATION)) == max(0, min(observed, window - 2 * one_chunk))
    engine.end(sid, "test")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_a_continuation_that_cannot_apply_is_fresh_and_one_that_does_not_fit_is_refused_unchanged(engine):
    fresh = engine.infer("fresh", infer(engine, 1, 1, Continuation(0, 2))).result  # nothing to continue yet
    plain = engine.infer("plain", infer(engine, 1, 1)).result
    assert (fresh.chunk.frozen, fresh.chunk.continuation) == (0, NO_PREVIOUS_CHUNK)
    np.testing.assert_array_equal(fresh.actions, plain.actions)  # served as the chunk it would have been
    unknown = engine.infer("fresh", infer(engine, 1, 2, Continuation(4, 4, chunk_id=7))).result
    assert (unknown.chunk.chunk_id, unknown.chunk.frozen, unknown.chunk.continuation) == (2, 0, UNKNOWN_CHUNK_ID)
    state = engine.sessions["plain"].policy_state.episode
    before = (state.chunks, state.last, state.frame_start, state.kv.pages_held)
    for bad, words in ((Continuation(30, 4), "past the 32-action chunk"), (Continuation(-1, 0), "continuation.executed")):
        (reply,) = engine.run([Infer(1, "plain", infer(engine, 1, 2, bad))])
        assert isinstance(reply, ErrorReply) and reply.kind is ErrorKind.BAD_REQUEST and words in reply.message
    assert (state.chunks, state.last, state.frame_start, state.kv.pages_held) == before
    continued = engine.infer("plain", infer(engine, 1, 2, Continuation(20, 4))).result  # the session is as it was
    np.testing.assert_array_equal(continued.actions[:4], plain.actions[20:24])
    (reply,) = engine.run([Infer(2, "plain", infer(engine, 1, 3, Continuation(4, 4)))])  # chunk 1 still uncommitted
    assert isinstance(reply, ErrorReply) and "compute_kv_cache the chunk it continued first" in reply.message
    for sid in ("fresh", "plain"):
        engine.end(sid, "test")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_batched_equals_alone_and_a_failed_batch_puts_its_members_back(engine, monkeypatch):
    """Two robots' episodes in lockstep equal each alone. At the second continuation the batched attempt fails once
    (b's stand-in, after a's was written and both sessions' generators moved): both are put back as they were (KV
    pages, chunks, frame position, generator) and retried alone, which gives each what it gets alone."""
    alone = [r.actions for r in episode(engine, "alone")]
    engine.end("alone", "test")
    steps = [
        lambda sid, out: infer(engine, 1, 1),
        lambda sid, out: infer(engine, 1, 2, Continuation(20, 4, chunk_id=1)),
        lambda sid, out: commit(engine, 4, 3, out[sid][0]),
        lambda sid, out: infer(engine, 1, 4, Continuation(8, 8, chunk_id=2)),
        lambda sid, out: commit(engine, 8, 5, out[sid][1]),
    ]
    stand_in, failures = LingBotVAEpisodes._stand_in, []

    def fails_once(self, session, chunk):
        if session.session_id == "b" and not failures:
            failures.append(session.session_id)
            raise RuntimeError("injected")
        return stand_in(self, session, chunk)

    monkeypatch.setattr(LingBotVAEpisodes, "_stand_in", fails_once)
    out = {"a": [], "b": []}
    ids = iter(range(100, 200))
    for make in steps:
        replies = engine.run([Infer(next(ids), sid, make(sid, out)) for sid in ("a", "b")])
        assert [r.batch_size for r in replies] == [2, 2]
        for sid, reply in zip(("a", "b"), replies):
            assert not isinstance(reply, ErrorReply), reply.message
            out[sid].append(reply.actions)
    assert failures == ["b"]
    for sid in ("a", "b"):
        for got, expected in zip(out[sid], alone, strict=True):
            np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
        engine.end(sid, "test")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_a_call_that_fails_ends_its_session_and_returns_every_page(engine, monkeypatch):
    first = engine.infer("failing", infer(engine, 1, 1)).result
    engine.infer("failing", infer(engine, 1, 2, Continuation(20, 4)))
    engine.infer("failing", commit(engine, 4, 3, first.actions))

    def broken(self, session, chunk):
        raise RuntimeError("injected")

    monkeypatch.setattr(LingBotVAEpisodes, "_stand_in", broken)
    (reply,) = engine.run([Infer(1, "failing", infer(engine, 1, 4, Continuation(8, 8)))])
    assert isinstance(reply, ErrorReply) and reply.kind is ErrorKind.POLICY and "injected" in reply.message
    assert "failing" not in engine.sessions and engine.cache.pool.num_free == engine.cache.pool.capacity


def test_openpi_continues_over_the_committed_chunk(engine):
    """OpenPI: the request's frames commit the chunk out, then the next chunk is pinned to it."""
    sid = "openpi"
    first = engine.infer(sid, RobotObservation(cameras(engine, 1, 1), {}, PROMPT)).result
    second = engine.infer(sid, RobotObservation(cameras(engine, 4, 2), {}, PROMPT, continuation=Continuation(24, 6, chunk_id=1))).result
    assert (second.chunk.call, second.chunk.chunk_id, second.chunk.frozen, second.chunk.continuation) == ("commit+infer", 2, 6, APPLIED)
    np.testing.assert_array_equal(second.actions[:6], first.actions[24:30])
    engine.end(sid, "test")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_the_shared_inpaint_step_moves_only_weighted_rows_and_pins_the_frozen_ones_exactly():
    """``ardiff_policies.action_inpaint`` (both families): weight 0 leaves a row bitwise, weight 1 at sigma s makes it the
    target noised to s, and the final pin puts the frozen rows exactly on the target."""
    import torch

    from ardiff_policies import action_inpaint
    from ardiff_policies.continuation import soft_mask

    g = torch.Generator().manual_seed(0)
    x, target, noise = (torch.randn(1, 3, 8, generator=g) for _ in range(3))
    weights = torch.from_numpy(soft_mask(8, 2, 6)).float().reshape(1, 1, 8)
    moved = action_inpaint.toward(x, target, weights, noise, 0.3)
    torch.testing.assert_close(moved[..., :2], 0.7 * target[..., :2] + 0.3 * noise[..., :2])
    assert torch.equal(moved[..., 6:], x[..., 6:]) and not torch.equal(moved[..., 2:6], x[..., 2:6])
    frozen = torch.zeros(1, 1, 8, dtype=torch.bool)
    frozen[..., :2] = True
    pinned = action_inpaint.pin(x, target, weights, frozen)
    assert torch.equal(pinned[..., :2], target[..., :2]) and torch.equal(pinned[..., 6:], x[..., 6:])
