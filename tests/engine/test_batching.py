"""Several robots in one forward: a batched engine step equals each session's unbatched calls.

The engine serves what waits together as one batch (``SessionEngine.run``, the scheduler's batches); every session's
actions must equal what the same session gets when it runs alone (fp32, max abs <= 1e-5), over
whole episodes with window restarts, prompt changes, ends and sessions joining and leaving at
any point. The reference is the same engine code with batches of one.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.messages import ErrorKind, ErrorReply, Infer, InferReply
from tests.helpers.batching import ATOL, alone, make_engine, observation, serve


@pytest.fixture(scope="module")
def reference_engine(tiny_model):
    return make_engine(tiny_model, max_sessions=2, max_batch=1)


def test_a_mixed_batch_equals_each_session_alone(tiny_model, reference_engine):
    """One batch holding a first call (1 frame), later calls (4 frames), a window restart and a
    prompt change; then every robot in lockstep for a whole window."""
    rng = np.random.default_rng(7)
    engine = make_engine(tiny_model)
    # robot "w" is 4 calls in (its 5th call restarts the window), "p" changes its prompt on its 3rd call
    episodes: dict[str, list[RobotObservation]] = {
        "w": [observation(rng, i == 0) for i in range(8)],
        "p": [observation(rng, i == 0, "pick up the cup" if i < 2 else "put the block in the bowl") for i in range(4)],
        "l": [observation(rng, i == 0) for i in range(3)],
        "n": [observation(rng, True)],
    }
    got: dict[str, list[np.ndarray]] = {sid: [] for sid in episodes}
    for i in range(4):  # w runs ahead alone
        got["w"].append(serve(engine, [Infer(i, "w", episodes["w"][i])])["w"].actions)
    for i in range(2):
        batch = serve(engine, [Infer(10 + i, "p", episodes["p"][i]), Infer(20 + i, "l", episodes["l"][i])])
        got["p"].append(batch["p"].actions)
        got["l"].append(batch["l"].actions)
    mixed = [Infer(30, "w", episodes["w"][4]), Infer(31, "p", episodes["p"][2]), Infer(32, "l", episodes["l"][2]), Infer(33, "n", episodes["n"][0])]
    batch = serve(engine, mixed)
    assert all(reply.batch_size == 4 for reply in batch.values())
    assert batch["w"].info["window_restart"] and batch["p"].info["prompt_change"] and batch["n"].new_session
    assert [batch[s].info["current_start_frame"] for s in "wpln"] == [3, 3, 7, 3]
    for sid in "wpln":
        got[sid].append(batch[sid].actions)
    batch = serve(engine, [Infer(40, "w", episodes["w"][5]), Infer(41, "p", episodes["p"][3])])
    got["w"].append(batch["w"].actions)
    got["p"].append(batch["p"].actions)
    for i in range(6, 8):
        got["w"].append(serve(engine, [Infer(40 + i, "w", episodes["w"][i])])["w"].actions)
    for sid, episode in episodes.items():
        reference = alone(reference_engine, f"ref-{sid}", episode[: len(got[sid])])
        for call, (a, b) in enumerate(zip(reference, got[sid])):
            np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")
    assert engine.batches[4] == 1 and engine.batches[2] >= 2


def test_the_dynamic_step_cache_decides_per_session_in_a_batch(tiny_model):
    """dit_step_cache: dynamic, robots at different points of their episodes batched together: each
    session skips exactly the DiT steps it skips alone, so its actions equal its unbatched ones."""
    rng = np.random.default_rng(11)
    episodes = {sid: [observation(rng, i == 0) for i in range(6)] for sid in "abc"}
    engine = make_engine(tiny_model, dit_step_cache="dynamic")
    got: dict[str, list[InferReply]] = {sid: [] for sid in episodes}
    for i in range(2):  # "a" runs two calls ahead
        got["a"].append(serve(engine, [Infer(i, "a", episodes["a"][i])])["a"])
    for i in range(4):
        members = [("a", i + 2), ("b", i), ("c", i)]
        batch = serve(engine, [Infer(100 * (n + 1) + i, sid, episodes[sid][k]) for n, (sid, k) in enumerate(members)])
        for sid, _ in members:
            assert batch[sid].batch_size == 3
            got[sid].append(batch[sid])
    reference_engine = make_engine(tiny_model, max_sessions=2, max_batch=1, dit_step_cache="dynamic")
    forwards = set()
    for sid, replies in got.items():
        expected = []
        for i, obs in enumerate(episodes[sid][: len(replies)]):
            expected.append(serve(reference_engine, [Infer(i, f"ref-{sid}", obs)])[f"ref-{sid}"])
        reference_engine.end(f"ref-{sid}", "done")
        for call, (a, b) in enumerate(zip(expected, replies)):
            assert b.info["dit_forwards"] == a.info["dit_forwards"], f"{sid} call {call}"
            np.testing.assert_allclose(b.actions, a.actions, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")
            forwards.add(a.info["dit_forwards"])
    assert min(forwards) < 16, "the dynamic cache never skipped a step: the test would not see a wrong decision"


events = st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(["infer", "infer", "infer", "infer", "end", "prompt"])), min_size=6, max_size=18)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedule=events, split=st.lists(st.integers(1, 4), min_size=18, max_size=18))
def test_random_interleavings_equal_each_session_alone(tiny_model, reference_engine, schedule, split):
    """Sessions join, leave (end), change prompts and restart windows in random order; the
    requests that are waiting together are served as one batch (cut by ``split``)."""
    rng = np.random.default_rng(len(schedule))
    engine = make_engine(tiny_model)
    episodes: dict[str, list[RobotObservation | None]] = {}
    fresh: dict[str, bool] = {}
    prompts: dict[str, str] = {}
    waiting: list[tuple[str, RobotObservation]] = []
    got: dict[str, list[np.ndarray]] = {}

    def flush() -> None:
        while waiting:
            size = split[len(got) % len(split)] if split else 1
            batch, waiting[:] = waiting[:size], waiting[size:]
            replies = serve(engine, [Infer(i, sid, obs) for i, (sid, obs) in enumerate(batch)])
            for sid, _ in batch:
                assert isinstance(replies[sid], InferReply), replies[sid]
                got.setdefault(sid, []).append(replies[sid].actions)

    for sid, event in schedule:
        if any(w[0] == sid for w in waiting):  # one request per session in flight, as the front end guarantees
            flush()
        if event == "end":
            flush()
            engine.end(sid, "reset")
            episodes.setdefault(sid, []).append(None)
            fresh[sid] = True
            continue
        if event == "prompt":
            prompts[sid] = "put the block in the bowl" if prompts.get(sid) != "put the block in the bowl" else "pick up the cup"
        obs = observation(rng, fresh.get(sid, True), prompts.get(sid, "pick up the cup"))
        fresh[sid] = False
        episodes.setdefault(sid, []).append(obs)
        waiting.append((sid, obs))
    flush()
    for sid, episode in episodes.items():
        reference = alone(reference_engine, f"ref-{sid}", episode)
        assert len(reference) == len(got.get(sid, []))
        for call, (a, b) in enumerate(zip(reference, got.get(sid, []))):
            np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")
    engine.end_all("done")
    assert engine.cache.pool.num_free == engine.cache.pool.capacity


def test_a_bad_request_never_enters_the_batch_and_a_failed_forward_tears_down_only_its_members(tiny_model, monkeypatch):
    rng = np.random.default_rng(1)
    engine = make_engine(tiny_model)
    serve(engine, [Infer(0, "bystander", observation(rng, True))])
    bad = RobotObservation(exterior_left=np.zeros((2, 1, 1, 3), np.uint8), prompt="x")  # 1-pixel images: refused
    replies = serve(engine, [Infer(1, "a", observation(rng, True)), Infer(2, "bad", bad), Infer(3, "b", observation(rng, True))])
    assert isinstance(replies["bad"], ErrorReply) and replies["bad"].kind is ErrorKind.BAD_REQUEST
    assert "bad" not in engine.sessions and replies["a"].batch_size == replies["b"].batch_size == 2
    free_before = engine.cache.pool.num_free

    dit = engine.policy.dit
    real_forward = dit.forward

    def exploding(*args, **kwargs):
        if kwargs.get("action") is not None:  # inside the denoise loop, after the prefill committed
            raise RuntimeError("GPU fell over")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(dit, "forward", exploding)
    replies = serve(engine, [Infer(4, "a", observation(rng, False)), Infer(5, "b", observation(rng, False))])
    monkeypatch.setattr(dit, "forward", real_forward)
    for sid in ("a", "b"):
        assert isinstance(replies[sid], ErrorReply) and replies[sid].kind is ErrorKind.POLICY and "GPU fell over" in replies[sid].message
        assert sid not in engine.sessions
    assert engine.endings["failed"] == 2 and "bystander" in engine.sessions
    # the members' pages (their committed prefill included) are back; the bystander kept its own
    held_by_bystander = engine.sessions["bystander"].kv.pages_held
    assert engine.cache.pool.num_free == engine.cache.pool.capacity - held_by_bystander and engine.cache.pool.num_free > free_before
    again = serve(engine, [Infer(6, "a", observation(rng, True)), Infer(7, "bystander", observation(rng, False))])
    assert again["a"].new_session and not again["bystander"].new_session and again["a"].batch_size == 2


def test_one_sessions_own_failure_fails_only_that_session(tiny_model, monkeypatch):
    rng = np.random.default_rng(2)
    engine = make_engine(tiny_model)
    policy = engine.policy
    real_begin = policy._begin

    def begin(call):
        if call.observation.prompt == "explode":
            raise ValueError("tokenizer broke on this prompt")
        return real_begin(call)

    monkeypatch.setattr(policy, "_begin", begin)
    replies = serve(engine, [Infer(1, "ok", observation(rng, True)), Infer(2, "boom", observation(rng, True, "explode"))])
    assert isinstance(replies["ok"], InferReply) and "ok" in engine.sessions
    assert isinstance(replies["boom"], ErrorReply) and "tokenizer broke" in replies["boom"].message and "boom" not in engine.sessions


def test_a_failed_vae_encode_fails_only_the_sessions_it_encoded(tiny_model, monkeypatch):
    """A session at its first call encodes nothing in the batched re-encode of observed frames:
    an out-of-memory error there must not tear it down."""
    rng = np.random.default_rng(3)
    engine = make_engine(tiny_model)
    serve(engine, [Infer(0, "old", observation(rng, True))])

    def out_of_memory(video):
        raise RuntimeError("CUDA out of memory in the batched VAE encode")

    monkeypatch.setattr(engine.policy.inputs, "observation_latents", out_of_memory)
    replies = serve(engine, [Infer(1, "old", observation(rng, False)), Infer(2, "new", observation(rng, True))])
    assert isinstance(replies["old"], ErrorReply) and "out of memory" in replies["old"].message and "old" not in engine.sessions
    assert isinstance(replies["new"], InferReply) and replies["new"].new_session and "new" in engine.sessions


def test_a_new_session_that_does_not_fit_is_refused_and_the_batch_runs(tiny_model):
    rng = np.random.default_rng(3)
    engine = make_engine(tiny_model, max_sessions=4, pool_sessions=2)  # room for two sessions' pages
    replies = serve(engine, [Infer(i, sid, observation(rng, True)) for i, sid in enumerate(["a", "b", "c"])])
    assert replies["a"].batch_size == replies["b"].batch_size == 2
    assert isinstance(replies["c"], ErrorReply) and replies["c"].kind is ErrorKind.CAPACITY and "the KV pool holds 2" in replies["c"].message
    assert set(engine.sessions) == {"a", "b"}  # no robot's session was evicted for c
    engine.detach("a", "disconnected")
    replies = serve(engine, [Infer(3, "c", observation(rng, True))])  # now c may take the idle session's place
    assert replies["c"].new_session and set(engine.sessions) == {"b", "c"} and engine.endings["pressure"] == 1


def test_a_batch_never_evicts_its_own_members(tiny_model):
    """A new session N and a detached session D whose robot came back, in one admission round, with
    the pool full: N may not take D's place (D's robot is waiting on it), and so D's request never
    has to evict an attached robot's session either. Before: two episodes lost (D's, then another's)."""
    rng = np.random.default_rng(4)
    engine = make_engine(tiny_model, max_sessions=2)
    serve(engine, [Infer(0, "A", observation(rng, True)), Infer(1, "D", observation(rng, True))])
    engine.detach("D", "disconnected")
    replies = serve(engine, [Infer(2, "N", observation(rng, True)), Infer(3, "D", observation(rng, False))])
    assert isinstance(replies["N"], ErrorReply) and replies["N"].kind is ErrorKind.CAPACITY
    assert isinstance(replies["D"], InferReply) and not replies["D"].new_session and replies["D"].calls == 2
    assert set(engine.sessions) == {"A", "D"} and not engine.endings
    assert not serve(engine, [Infer(4, "A", observation(rng, False))])["A"].new_session


def test_a_failed_batched_phase_is_retried_member_by_member(tiny_model, reference_engine, monkeypatch):
    """A forward that fails only because of the batch (an out-of-memory at 3 sessions) costs no one
    their call: each member is retried alone and gets exactly its unbatched reply. A member that
    fails alone too (a corrupt input) ends, with its own error; the others carry on."""
    rng = np.random.default_rng(5)
    episodes = {sid: [observation(rng, i == 0) for i in range(3)] for sid in "abc"}
    engine = make_engine(tiny_model)
    dit = engine.policy.dit
    real_forward = dit.forward
    forwards: list[int] = []

    def batch_oom(x, *args, **kwargs):
        forwards.append(x.shape[0])
        if x.shape[0] > 2 * len(engine.policy.branches):
            raise RuntimeError("CUDA out of memory (a batch of 3)")
        return real_forward(x, *args, **kwargs)

    monkeypatch.setattr(dit, "forward", batch_oom)
    got: dict[str, list[np.ndarray]] = {sid: [] for sid in episodes}
    for i in range(3):
        replies = serve(engine, [Infer(10 * i + n, sid, episodes[sid][i]) for n, sid in enumerate("abc")])
        for sid in "abc":
            assert isinstance(replies[sid], InferReply), replies[sid]
            assert replies[sid].calls == i + 1 and replies[sid].batch_size == 3
            got[sid].append(replies[sid].actions)
    assert max(forwards) == 3 * len(engine.policy.branches)  # the batched forward was tried
    monkeypatch.setattr(dit, "forward", real_forward)
    for sid, episode in episodes.items():
        for call, (a, b) in enumerate(zip(alone(reference_engine, f"ref-{sid}", episode), got[sid])):
            np.testing.assert_allclose(b, a, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")

    poisoned = observation(rng, False)
    real_denoise = engine.policy._denoise

    def denoise(calls):
        if any(c.observation is poisoned for c in calls):
            raise ValueError("NaN in this session's latents")
        return real_denoise(calls)

    monkeypatch.setattr(engine.policy, "_denoise", denoise)
    replies = serve(engine, [Infer(40, "a", observation(rng, False)), Infer(41, "b", poisoned), Infer(42, "c", observation(rng, False))])
    assert isinstance(replies["b"], ErrorReply) and "NaN in this session" in replies["b"].message and "b" not in engine.sessions
    assert isinstance(replies["a"], InferReply) and isinstance(replies["c"], InferReply) and replies["a"].calls == replies["c"].calls == 4
    assert engine.endings == {"failed": 1}


def test_a_member_retried_after_a_failure_mid_denoise_starts_clean(tiny_model, monkeypatch):
    """The batched denoise fails at its third DiT forward (the step cache has two velocities by then):
    each member's retry alone starts from a clean state, so with ``dit_step_cache: dynamic`` it skips
    exactly the steps it skips alone and counts only its own forwards. Before: the retry kept the failed
    attempt's history, countdown and forward count (actions off by up to 0.02, dit_forwards inflated)."""
    rng = np.random.default_rng(13)
    episodes = {sid: [observation(rng, i == 0) for i in range(3)] for sid in "abc"}
    engine = make_engine(tiny_model, dit_step_cache="dynamic")
    policy, dit = engine.policy, engine.policy.dit
    real_forward, real_denoise = dit.forward, policy._denoise
    batched_forwards = [0]
    failures: list[int] = []

    def denoise(calls):
        batched_forwards[0] = 0
        return real_denoise(calls)

    def forward(x, *args, **kwargs):
        if kwargs.get("action") is not None and x.shape[0] == 3 * len(policy.branches):
            batched_forwards[0] += 1
            if batched_forwards[0] == 3:
                failures.append(3)
                raise RuntimeError("CUDA out of memory (the third forward of a batch of 3)")
        return real_forward(x, *args, **kwargs)

    monkeypatch.setattr(policy, "_denoise", denoise)
    monkeypatch.setattr(dit, "forward", forward)
    got: dict[str, list[InferReply]] = {sid: [] for sid in episodes}
    for i in range(3):
        replies = serve(engine, [Infer(10 * i + n, sid, episodes[sid][i]) for n, sid in enumerate("abc")])
        for sid in "abc":
            assert isinstance(replies[sid], InferReply) and replies[sid].batch_size == 3, replies[sid]
            got[sid].append(replies[sid])
    assert len(failures) == 3  # every call's batched denoise failed part-way and was retried member by member
    monkeypatch.undo()
    reference = make_engine(tiny_model, max_sessions=2, max_batch=1, dit_step_cache="dynamic")
    forwards = set()
    for sid, episode in episodes.items():
        for call, obs in enumerate(episode):
            alone_reply = serve(reference, [Infer(call, f"ref-{sid}", obs)])[f"ref-{sid}"]
            assert got[sid][call].info["dit_forwards"] == alone_reply.info["dit_forwards"], f"{sid} call {call}"
            np.testing.assert_allclose(got[sid][call].actions, alone_reply.actions, atol=ATOL, rtol=0, err_msg=f"{sid} call {call}")
            forwards.add(alone_reply.info["dit_forwards"])
        reference.end(f"ref-{sid}", "done")
    assert min(forwards) < 16, "the dynamic cache never skipped a step: the test would not see a wrong decision"


def test_a_session_appears_once_per_batch():
    from tests.helpers.fake_policy import FakeConfig, FakePolicy

    policy = FakePolicy(FakeConfig(), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=8 * spec.pages_per_branch + 1, max_sessions=8, branches=policy.branches, max_batch=4)
    engine = SessionEngine(policy, cache, max_sessions=8, max_batch=4)
    replies = engine.run([Infer(1, "a", RobotObservation()), Infer(2, "a", RobotObservation()), Infer(3, "b", RobotObservation())])
    assert [(r.request_id, r.batch_size) for r in replies] == [(1, 2), (3, 2), (2, 1)]  # a's second call: the next batch
    assert [r.actions[0, 0] for r in replies] == [1, 1, 2]
