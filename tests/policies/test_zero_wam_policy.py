"""Zero-WAM behind the engine (policies/lingbot_va/zero_wam_policy.py, policy ``zero_wam``): the pinned demonstration
is counted in what a session reserves, never evicted, and returned on every path that ends a session; the RoboTwin
wire's reset begins the episode in a step of its own; an OpenPI session names its demonstration on its first call;
replies carry the typed ChunkInfo; recordings; several robots in one engine step equal each alone."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_kv import Branch, CapacityError, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.episode import EpisodeCall, EpisodeStart
from ardiff_policies.lingbot_va.zero_wam_config import ZeroWAMPolicyConfig
from ardiff_policies.lingbot_va.zero_wam_policy import build_zero_wam
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import ErrorReply, Infer

PROMPT = "grab the white mug"
DEMO = EpisodeStart(demonstration_id="tiny/wave", icl_guidance_scale=5.0)


@pytest.fixture(scope="module")
def policy():
    return build_zero_wam(ZeroWAMPolicyConfig(demonstration_root="builtin:tiny"), RuntimeOptions(record=True))


def engine_of(policy, sessions_in_pool: int, max_sessions: int = 16, max_batch: int = 1) -> SessionEngine:
    spec = policy.kv_spec()
    pages = sessions_in_pool * spec.reservation(2) + PagedKVCache.undo_headroom(spec, 2, max_batch) + 1
    cache = PagedKVCache(spec, num_pages=pages, max_sessions=max_sessions, branches=policy.branches, attention_backend="sdpa", max_batch=max_batch)
    return SessionEngine(policy, cache, max_sessions=max_sessions, max_batch=max_batch)


def observation(policy, frames: int, seed: int, call: EpisodeCall | None = None, prompt: str | None = PROMPT) -> RobotObservation:
    rng = np.random.default_rng(seed)
    cameras = {c: rng.integers(0, 256, (frames, 32, 64, 3), dtype=np.uint8) for c in policy.cameras}
    return RobotObservation(cameras=cameras, states={}, prompt=prompt, episode=call)


def openpi_chunk(policy, chunk: int, seed: int, start: EpisodeStart | None = DEMO) -> RobotObservation:
    """An OpenPI session's calls: one frame first (naming its demonstration), then each chunk's key frames."""
    frames = 1 if chunk == 0 else 4 * (2 - (chunk == 1))
    return observation(policy, frames, 100 * seed + chunk, EpisodeCall("chunk", start=start) if chunk == 0 and start else None)


def test_the_pinned_block_is_reserved_never_evicted_and_returned_on_every_ending_path(policy, monkeypatch):
    engine = engine_of(policy, sessions_in_pool=2)
    pool, spec = engine.cache.pool, policy.kv_spec()
    assert engine.cache.reservation_per_session == spec.reservation(2) and spec.max_pinned_pages == 4  # the bound, whatever the demo
    for chunk in range(5):  # the window (two chunks) slides; the block stays
        engine.infer("a", openpi_chunk(policy, chunk, 1))
    cond = engine.sessions["a"].kv.branch(Branch.COND)
    assert len(cond.pinned) == 2 and cond.evicted_pages > 0 and not engine.sessions["a"].kv.branch(Branch.UNCOND).pinned
    engine.infer("b", openpi_chunk(policy, 0, 2))
    engine.detach("a", "switched")
    engine.detach("b", "switched")
    engine.infer("c", openpi_chunk(policy, 0, 3))  # admission evicts the least recently used idle session (a), block and all
    assert set(engine.sessions) == {"b", "c"} and engine.endings == {"pressure": 1}
    assert pool.num_allocated == engine.sessions["b"].kv.pages_held + engine.sessions["c"].kv.pages_held
    assert engine.end("b", "reset")  # a reset (and the TTL, the same call)
    original = type(policy.episodes)._commit

    def explode(self, accepted):
        raise RuntimeError("exploded")

    monkeypatch.setattr(type(policy.episodes), "_commit", explode)
    with pytest.raises(RuntimeError, match="exploded"):
        engine.infer("c", openpi_chunk(policy, 1, 3))  # a failed step ends the session: its block goes back with the rest
    monkeypatch.setattr(type(policy.episodes), "_commit", original)
    assert engine.sessions == {} and pool.num_allocated == 0
    engine.infer("d", openpi_chunk(policy, 0, 4))
    assert pool.num_allocated > 0
    engine.close()  # shutdown
    assert pool.num_free == pool.capacity


def test_a_pool_that_holds_the_windows_but_not_the_blocks_admits_no_more_sessions(policy):
    spec = policy.kv_spec()
    pages = spec.reservation(2) + spec.reservation(2) - spec.max_pinned_pages + 1  # two windows, one block
    cache = PagedKVCache(spec, num_pages=pages, max_sessions=4, branches=policy.branches, attention_backend="sdpa")
    assert cache.session_capacity == 1
    with pytest.raises(CapacityError, match="of which 4 in the COND branch for its pinned in-context block"):
        cache.open_session("one")
        cache.open_session("two")
    engine = SessionEngine(policy, PagedKVCache(spec, num_pages=pages, max_sessions=4, branches=policy.branches), max_sessions=4)
    engine.infer("a", openpi_chunk(policy, 0, 1))
    with pytest.raises(CapacityError, match=r"the KV pool holds 1 \(engine.max_sessions: 4\)"):
        engine.infer("b", openpi_chunk(policy, 0, 2))


def test_the_robotwin_reset_step_begins_the_episode_and_replies_say_their_chunk(policy):
    engine = engine_of(policy, sessions_in_pool=2)
    reset = RobotObservation(cameras={}, states={}, prompt=PROMPT, episode=EpisodeCall("reset", start=EpisodeStart(True, "tiny/wave", -1.0, 5.0)))
    outcome = engine.infer("conn", reset)
    assert outcome.result.actions.shape == (0, 16) and outcome.result.chunk.call == "reset"
    assert outcome.result.info["guidance"] == "in-context" and len(engine.sessions["conn"].kv.branch(Branch.COND).pinned) == 2
    served = engine.sessions["conn"].policy_state
    (infer,) = policy.step_batch([(served, observation(policy, 1, 5, EpisodeCall("infer", -1.0, 1.0)))])  # its scales: not read
    chunk = infer.chunk
    assert (chunk.chunk_id, chunk.frozen, chunk.call, chunk.execute_from) == (1, 0, "infer", 16)
    assert infer.actions.shape == (32, 16) and np.isfinite(infer.actions).all()
    assert infer.recording.predicted.shape == (1, 48, 2, 2, 12) and infer.recording.canvas.shape == (1, 32, 192, 3)  # recordings
    commit = engine.infer("conn", observation(policy, 4, 6, EpisodeCall("compute_kv_cache")))
    assert commit.result.chunk.call == "compute_kv_cache" and commit.result.actions.shape == (0, 16)
    with pytest.raises(UnsupportedObservation, match="reset: this session's episode has begun"):
        engine.infer("conn", reset)
    with pytest.raises(UnsupportedObservation, match="continuation: policy zero_wam does not continue chunks"):
        engine.infer("conn", RobotObservation(cameras={}, states={}, prompt=PROMPT, continuation=object()))
    again = engine.infer("conn", observation(policy, 1, 5, EpisodeCall("infer")))
    assert again.result.chunk.chunk_id == 2 and again.result.chunk.execute_from == 0
    engine.close()


def test_an_openpi_session_begins_on_its_first_call_and_keeps_its_demonstration(policy):
    engine = engine_of(policy, sessions_in_pool=3)
    first = engine.infer("s", openpi_chunk(policy, 0, 7))
    assert first.result.info["demonstration"] == "tiny/wave" and first.result.chunk.call == "infer"
    same = observation(policy, 4, 8, EpisodeCall("chunk", start=EpisodeStart(demonstration_id="tiny/wave")))
    assert engine.infer("s", same).result.chunk.call == "commit+infer"  # repeating how it began is fine
    for start, match in (
        (EpisodeStart(demonstration_id="tiny/stack_blocks/episode0"), "icl_demo_id: 'tiny/stack_blocks/episode0' differs"),
        (EpisodeStart(video_guidance_scale=5.0), r"video_guidance_scale: 5\.0 differs from this episode's -1\.0"),
        (EpisodeStart(use_icl=False), "use_icl: False differs"),
    ):
        with pytest.raises(UnsupportedObservation, match=match):
            engine.infer("s", observation(policy, 8, 9, EpisodeCall("chunk", start=start)))
    with pytest.raises(UnsupportedObservation, match="prompt: Zero-WAM's episode needs the task's prompt"):
        engine.infer("t", observation(policy, 1, 9, prompt=""))
    plain = engine.infer("u", openpi_chunk(policy, 0, 9, start=None))  # no demonstration named: none, one half
    assert plain.result.info["guidance"] == "none" and plain.result.info["demonstration"] is None
    engine.close()


def test_several_robots_in_one_engine_step_equal_each_alone(policy):
    starts = (DEMO, EpisodeStart(use_icl=False, video_guidance_scale=5.0), None)
    alone = []
    for seed, start in enumerate(starts):
        engine = engine_of(policy, sessions_in_pool=1)
        alone.append([engine.infer("x", openpi_chunk(policy, chunk, seed, start)).result.actions for chunk in range(3)])
        engine.close()
    engine = engine_of(policy, sessions_in_pool=3, max_sessions=3, max_batch=3)
    for chunk in range(3):
        requests = [Infer(i, f"r{i}", openpi_chunk(policy, chunk, i, start)) for i, start in enumerate(starts)]
        replies = engine.run(requests)
        assert not any(isinstance(r, ErrorReply) for r in replies) and {r.batch_size for r in replies} == {3}
        for i, reply in enumerate(replies):
            np.testing.assert_allclose(reply.actions, alone[i][chunk], atol=1e-5, rtol=0)
            assert reply.chunk.chunk_id == chunk + 1
    engine.close()
    assert engine.cache.pool.num_free == engine.cache.pool.capacity
