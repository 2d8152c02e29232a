"""The engine's scheduler (engine/scheduler.py): order, admission, batches; and what no robot pays for.

Each test of a guarantee here fails on the engine before the scheduler: a slow newcomer's encode
stalled its batch-mates, and a failure on one CFG-parallel rank left the other waiting.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import numpy as np
import pytest

from ardiff_kv import Branch, PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.guidance import Guidance
from ardiff_policies.observation import RobotObservation
from ardiff_policies.wan.samplers import FlowUniPCSampler
from ardiff_server.engine.core import SessionEngine
from ardiff_server.engine.inproc_client import InprocClient
from ardiff_server.engine.messages import Detach, End, ErrorKind, ErrorReply, Infer, InferReply
from ardiff_server.engine.scheduler import Admission, Admitted, Scheduler, SessionState, choose_victims
from tests.helpers.dreamzero import ThreadPair, make_policy, observations
from tests.helpers.fake_policy import FakeConfig, FakePolicy


def infer(request_id: int, session_id: str = "s", deadline: float | None = None) -> Infer:
    return Infer(request_id, session_id, RobotObservation(), deadline)


def admitted(scheduler: Scheduler, admission: Admission, *, ready: bool) -> None:
    """What the engine does with an admission: the request joins the one admitted table."""
    session = SessionState(admission.request.session_id, None, None)
    scheduler.admit(Admitted(admission.request, session, True, admission.queued_ms / 1000.0, admission.due), ready=ready)


def admit_all(scheduler: Scheduler, *, ready: bool = True) -> list[Admission]:
    admissions = list(scheduler.next_round().admit)
    for admission in admissions:
        admitted(scheduler, admission, ready=ready)
    return admissions


# -- order and batches ------------------------------------------------------------------


def test_control_requests_come_first_and_each_round_says_how_long_requests_waited():
    scheduler = Scheduler(max_batch=4)
    scheduler.put(infer(1, "a"))
    scheduler.put(infer(2, "b"))
    time.sleep(0.05)
    scheduler.put(End(3, "c", "reset"))
    assert scheduler.next_round().control == End(3, "c", "reset")  # a reset never waits behind inference
    admit = admit_all(scheduler)
    assert [a.request.request_id for a in admit] == [1, 2] and all(a.queued_ms >= 50.0 for a in admit)
    batch = scheduler.next_round().batch
    assert [rid for rid, _ in batch] == [1, 2] and all(ms >= 50.0 for _, ms in batch)


def test_batches_hold_distinct_sessions_in_arrival_order_up_to_max_batch():
    scheduler = Scheduler(max_batch=2)
    for request in (infer(1, "a"), infer(2, "a"), infer(3, "b"), infer(4, "c")):
        scheduler.put(request)
    admit_all(scheduler)
    first = [rid for rid, _ in scheduler.next_round().batch]
    assert first == [1, 3]  # a's second request waits for its first (never twice in one forward)
    scheduler.take(first)
    second = [rid for rid, _ in scheduler.next_round().batch]
    assert second == [2, 4]
    scheduler.take(second)
    assert scheduler.empty()


def test_a_request_whose_session_work_runs_does_not_hold_the_ready_ones_back():
    scheduler = Scheduler(max_batch=4)
    for request in (infer(1, "new"), infer(2, "steady")):
        scheduler.put(request)
    new, steady = scheduler.next_round().admit
    admitted(scheduler, new, ready=False)  # its first-call encodes run on the encoder thread
    admitted(scheduler, steady, ready=True)
    assert [rid for rid, _ in scheduler.next_round().batch] == [2]
    scheduler.take([2])
    assert scheduler.next_round(timeout_s=0.05) is None  # nothing ready: it waits for the encode
    threading.Timer(0.05, scheduler.prepared, args=(1,)).start()
    assert [rid for rid, _ in scheduler.next_round(timeout_s=5).batch] == [1]


def test_a_partial_batch_waits_only_when_told_and_never_past_a_control_request():
    scheduler = Scheduler(max_batch=2, batch_wait_s=2.0)
    scheduler.put(infer(1, "a"))
    admit_all(scheduler)
    threading.Timer(0.05, scheduler.put, args=(Detach(9, "z", "switched"),)).start()
    started = time.monotonic()
    assert scheduler.next_round().control is not None and time.monotonic() - started < 1.0  # the detach did not wait
    threading.Timer(0.05, scheduler.put, args=(infer(2, "b"),)).start()
    admit_all(scheduler)  # b arrived while a waited for company
    assert [rid for rid, _ in scheduler.next_round().batch] == [1, 2] and time.monotonic() - started < 1.5


def test_victims_are_idle_sessions_disconnected_first_never_attached_waiting_or_protected():
    class S:
        def __init__(self, status: str, waiting: int = 0) -> None:
            self.status, self.waiting = status, waiting

    table = {
        "old-switched": S("switched"),
        "attached": S("attached"),
        "gone-waiting": S("disconnected", 1),
        "gone": S("disconnected"),
        "peer": S("switched"),
    }
    assert choose_victims(table, 1, protect=()) == ["gone"]
    assert choose_victims(table, 2, protect=()) == ["gone", "old-switched"]
    assert choose_victims(table, 2, protect={"old-switched"}) == ["gone", "peer"]
    assert choose_victims(table, 4, protect=()) is None  # the attached and the waiting one never go
    assert choose_victims(table, 0, protect=()) == []


class AgreeingFakePolicy(FakePolicy):
    """The fake policy with CFG-parallel's agreement (``Guidance.agree``: an any-rank OR) when given a transport."""

    def __init__(self, guidance: Guidance | None = None) -> None:
        super().__init__(FakeConfig(), RuntimeOptions())
        self.guidance = guidance

    def agree(self, failed):
        return self.guidance.agree(list(failed)) if self.guidance is not None else list(failed)


def full_engine(policy: FakePolicy) -> SessionEngine:
    """Three sessions, all the engine holds: x with its robot on it, a disconnected, b switched away from."""
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=8 * spec.pages_per_branch + 1, max_sessions=8, branches=policy.branches)
    engine = SessionEngine(policy, cache, max_sessions=3)
    for request_id, sid in enumerate(("a", "b", "x")):
        assert isinstance(engine.run([infer(request_id, sid)])[0], InferReply)
    engine.detach("a", "disconnected")
    engine.detach("b", "switched")
    return engine


def admit_while_a_returns(engine: SessionEngine, *, returns: bool) -> None:
    """Execute the admission round [x, new c]; while x's request is checked (the round executes),
    a's robot's request reaches the scheduler (``returns``: on this rank; CFG rank 1 never sees it)."""
    x_request, c_request = infer(10, "x"), infer(11, "c")
    engine.scheduler.put(x_request)
    engine.scheduler.put(c_request)
    round = engine.scheduler.next_round()
    assert [a.victims for a in round.admit] == [(), ("a",)]  # the plan, as the table stood: a makes room for c
    real_check = engine.policy.check_observation

    def check(observation):
        if returns and observation is x_request.observation:
            engine.scheduler.put(infer(12, "a"))
        return real_check(observation)

    engine.policy.check_observation = check
    assert engine.execute(round) == []  # both admitted


def test_admission_never_ends_a_session_whose_request_arrived_while_the_round_executes():
    """a (disconnected) is the first victim for a new session c; a's robot reconnects and its request
    reaches the scheduler while c's admission round executes. Before: that arrival protected
    nothing, a was ended for c and its returning request started a fresh episode. Now arrivals are
    read under the scheduler's lock when the victims are chosen: b (switched away from) makes room."""
    engine = full_engine(AgreeingFakePolicy())
    admit_while_a_returns(engine, returns=True)
    assert sorted(engine.sessions) == ["a", "c", "x"] and engine.endings == {"lru": 1}
    assert engine.scheduler.arrived_sessions() == {"a"}
    replies = {}
    while len(replies) < 3:
        replies.update((r.request_id, r) for r in engine.execute(engine.scheduler.next_round(wait_for_prepared=True)))
    assert replies[12].calls == 2 and not replies[12].new_session  # a's robot carries on its episode
    assert replies[11].new_session and replies[10].calls == 2


def test_cfg_ranks_protect_what_rank_0_saw_arrive_and_evict_the_same_session():
    """Only rank 0's scheduler takes requests: rank 1 learns of a's arrival through the ranks'
    agreement, so both end b (different victims would put their tables, and batches, out of step)."""
    pair = ThreadPair()
    tables: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        engine = full_engine(AgreeingFakePolicy(Guidance.parallel(r, pair.endpoint(r))))
        admit_while_a_returns(engine, returns=r == 0)
        tables[r] = sorted(engine.sessions)

    pair.run(rank, timeout_s=60)
    assert tables == {0: ["a", "c", "x"], 1: ["a", "c", "x"]}


# -- no robot pays for another's arrival --------------------------------------------------


def fake_engine(max_batch: int = 4, delay_s: float = 0.0) -> SessionEngine:
    policy = FakePolicy(FakeConfig(max_batch=max_batch, delay_s=delay_s), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=8 * spec.pages_per_branch + 1, max_sessions=8, branches=policy.branches, max_batch=max_batch)
    return SessionEngine(policy, cache, max_sessions=8, max_batch=max_batch)


def test_a_slow_first_call_encode_never_stalls_three_steady_robots():
    """Three robots calling back to back; a fourth arrives whose first call needs 1.5 s of
    session-own encoding. Before: its encode ran inside the batched step, and every steady robot's
    call took 1.5 s longer. Now it runs on the encoder thread and the steady robots never notice."""
    encode_s = 1.5
    engine = fake_engine(delay_s=0.02)

    async def scenario() -> tuple[list[float], list[float], float]:
        client = InprocClient(engine)
        await client.start()
        steady_before: list[float] = []
        steady_during: list[float] = []
        newcomer_done = asyncio.Event()

        async def robot(name: str) -> None:
            calls = 0
            while not newcomer_done.is_set() or calls < 5:
                started = time.perf_counter()
                reply = await client.infer(name, RobotObservation(prompt="steady"))
                assert reply.calls == calls + 1
                calls += 1
                (steady_during if arrived.is_set() and not newcomer_done.is_set() else steady_before).append(time.perf_counter() - started)

        async def newcomer() -> float:
            await asyncio.sleep(0.3)
            arrived.set()
            started = time.perf_counter()
            reply = await client.infer("newcomer", RobotObservation(prompt=f"encode:{encode_s}"))
            newcomer_done.set()
            assert reply.new_session and reply.calls == 1
            return time.perf_counter() - started

        arrived = asyncio.Event()
        results = await asyncio.gather(robot("r1"), robot("r2"), robot("r3"), newcomer())
        await client.stop()
        return steady_before, steady_during, results[-1]

    before, during, newcomer_s = asyncio.run(scenario())
    assert newcomer_s >= encode_s  # its encode did run
    assert len(during) >= 6, during  # the steady robots kept being served while it encoded
    assert max(during) < encode_s / 3, f"a steady robot waited {max(during):.2f} s behind the newcomer's encode"
    print(
        f"steady robots' calls: before {np.median(before) * 1000:.0f} ms, during the encode {np.median(during) * 1000:.0f} ms "
        f"(max {max(during) * 1000:.0f} ms); the newcomer's first call {newcomer_s * 1000:.0f} ms"
    )


def test_a_calls_own_encode_is_its_compute_and_waiting_for_anothers_is_queueing():
    """Two newcomers at once, each with 0.3 s of session-own encoding on the one encoder thread. Each reply's
    encode_ms is its own encode; the second waited 0.3 s behind the first's: queueing. Before: encode_ms did not
    exist and the wait for the encoder thread counted as neither."""
    engine = fake_engine()

    async def scenario() -> list[InferReply]:
        client = InprocClient(engine)
        await client.start()
        first = asyncio.ensure_future(client.infer("a", RobotObservation(prompt="encode:0.3")))
        await asyncio.sleep(0.05)  # a is on the encoder thread when b arrives
        second = asyncio.ensure_future(client.infer("b", RobotObservation(prompt="encode:0.3")))
        replies = [await first, await second]
        await client.stop()
        return replies

    a, b = asyncio.run(scenario())
    assert a.encode_ms >= 300 and b.encode_ms >= 300 and a.infer_ms == a.compute_ms + a.encode_ms
    assert a.queue_ms < 100, a.queue_ms  # nothing in front of it
    assert 150 < b.queue_ms < 450, b.queue_ms  # behind a's encode (0.3 s, less the 0.05 s it came later)


def test_the_step_does_the_session_work_itself_when_it_did_not_run_beforehand():
    engine = fake_engine()
    started = time.perf_counter()
    (reply,) = engine.run([Infer(1, "a", RobotObservation(prompt="encode:0.2"))])
    assert isinstance(reply, InferReply) and time.perf_counter() - started >= 0.2 and engine.sessions["a"].policy_state.encoded


def test_dreamzero_prepares_window_starts_off_the_batch_and_gives_the_same_actions(tiny_model):
    """A first call, a prompt change and a window restart: their encodes run on the encoder thread
    (the policy's own path: prepared beforehand) and the actions equal the step's own encodes'."""
    results = {}
    for prepared in (True, False):
        policy, cache = make_policy(tiny_model)
        engine = SessionEngine(policy, cache, max_sessions=3, max_batch=2)
        if not prepared:
            engine.policy.prepare = lambda session, observation: None
        made = []
        real_begin = policy._begin

        def begin(call, real_begin=real_begin, made=made):
            made.append(call.session.prepared is not None)
            return real_begin(call)

        policy._begin = begin
        obs = list(observations(7))
        obs[3:] = [RobotObservation(**{**o.__dict__, "prompt": "put the block in the bowl"}) for o in obs[3:]]
        replies = [engine.run([Infer(i, "s", o)])[0] for i, o in enumerate(obs)]
        assert all(isinstance(r, InferReply) for r in replies), replies
        results[prepared] = (replies, made)
    replies, made = results[True]
    events = [(r.info.get("prompt_change"), r.info.get("window_restart")) for r in replies]
    starts = [i for i, r in enumerate(replies) if i == 0 or r.info.get("prompt_change") or r.info.get("window_restart")]
    assert len(starts) >= 2, events
    assert [made[i] for i in starts] == [True] * len(starts) and not any(made[i] for i in range(len(made)) if i not in starts)
    for a, b in zip(results[True][0], results[False][0]):
        assert np.array_equal(a.actions, b.actions)


def test_frames_past_what_the_policy_keeps_are_dropped_before_any_pixel_work(tiny_model, monkeypatch):
    from ardiff_policies.dreamzero import inputs

    policy, _ = make_policy(tiny_model)
    seen: list[int] = []
    real = inputs.crop_and_resize
    monkeypatch.setattr(inputs, "crop_and_resize", lambda frames, *a, **k: (seen.append(frames.shape[0]), real(frames, *a, **k))[1])
    frames = np.zeros((64, 90, 160, 3), np.uint8)
    canvas = policy.inputs.canvas(RobotObservation(exterior_left=frames, exterior_right=frames, wrist=frames, prompt="x"))
    assert canvas.shape[0] == inputs.FRAMES_PER_CALL and seen == [inputs.FRAMES_PER_CALL] * 3


def test_the_front_end_drops_the_frames_dreamzero_would_before_decoding_and_the_canvas_is_the_same(tiny_model, monkeypatch):
    """DreamZero says it reads the newest FRAMES_PER_CALL frames (PolicyInfo.keeps_newest_frames), so the front end
    decodes only those: a 64-frame JPEG stack costs 4 decodes, and the policy's canvas equals the whole stack's."""
    from PIL import ImageFile

    from ardiff_policies.dreamzero import inputs
    from ardiff_server.wire.budget import request_budget
    from ardiff_server.wire.decode import decode_request
    from ardiff_server.wire.jpeg import decode_jpeg, encode_jpeg

    policy, _ = make_policy(tiny_model)
    assert (policy.info.max_frames_per_call, policy.info.keeps_newest_frames) == (inputs.FRAMES_PER_CALL, True)
    rng = np.random.default_rng(0)
    jpegs = [encode_jpeg(rng.integers(0, 256, (90, 160, 3), dtype=np.uint8)) for _ in range(64)]
    whole = np.stack([decode_jpeg(j, 4096) for j in jpegs])
    request = {f"observation/{key}": jpegs for key in ("exterior_image_0_left", "exterior_image_1_left", "wrist_image_left")}
    request.update({"observation/joint_position": np.zeros(7), "observation/gripper_position": np.zeros(1), "prompt": "x"})
    loads = []
    real_load = ImageFile.ImageFile.load
    # a load with tiles left decodes pixels (a loaded image's later load() calls decode nothing)
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: (image.tile and loads.append(image.size), real_load(image))[1])
    observation = decode_request(request, budget=request_budget("auto", policy.info)).observation
    assert len(loads) == 3 * inputs.FRAMES_PER_CALL and observation.wrist.shape == (inputs.FRAMES_PER_CALL, 90, 160, 3)
    sent = RobotObservation(exterior_left=whole, exterior_right=whole, wrist=whole, prompt="x")
    assert np.array_equal(policy.inputs.canvas(observation), policy.inputs.canvas(sent))


# -- CFG-parallel ranks agree ------------------------------------------------------------


def run_ranks(tiny_model, sabotage, calls: list[list[tuple[str, RobotObservation]]], pair: ThreadPair | None = None) -> dict[int, list[list]]:
    """Two CFG-parallel ranks (threads meeting at a barrier, as two processes meet in collectives),
    each its own engine, serving the same rounds; ``sabotage(rank, policy)`` breaks one of them."""
    pair = pair or ThreadPair()
    replies: dict[int, list[list]] = {0: [], 1: []}

    def rank(r: int) -> None:
        policy, _ = make_policy(copy.deepcopy(tiny_model), branches=(Branch(r),), guidance=Guidance.parallel(r, pair.endpoint(r)))
        spec = policy.kv_spec()
        cache = PagedKVCache(spec, num_pages=3 * spec.pages_per_branch + 1, max_sessions=3, branches=(Branch(r),), max_batch=3)
        engine = SessionEngine(policy, cache, max_sessions=3, max_batch=3)
        sabotage(r, policy)
        for k, batch in enumerate(calls):
            replies[r].append(engine.run([Infer(10 * k + i, sid, obs) for i, (sid, obs) in enumerate(batch)]))
        replies[r].append(sorted(engine.sessions))

    pair.run(rank)
    return replies


@pytest.mark.parametrize("phase", ["encode", "denoise"])
def test_a_failure_on_one_cfg_rank_fails_the_same_session_on_both(tiny_model, phase):
    """Rank 1's re-encode (or its denoise forward) fails for one session only. Before: rank 0 went
    on with a batch rank 1 had dropped a member from, and the two waited on each other (or
    exchanged mismatched tensors) until the watchdog restarted the replica."""
    rollouts = {sid: list(observations(2, seed=n)) for n, sid in enumerate(("a", "victim", "c"))}
    calls = [[(sid, obs[k]) for sid, obs in rollouts.items()] for k in range(2)]
    victim_obs = rollouts["victim"][1]

    def sabotage(rank: int, policy) -> None:
        if rank != 1:
            return
        if phase == "encode":
            real = policy._encode_observed

            def encode(group):
                if any(c.observation is victim_obs for c in group):
                    raise RuntimeError("rank 1: VAE encode failed")
                return real(group)

            policy._encode_observed = encode
        else:
            dit, real_forward, real_denoise = policy.dit, policy.dit.forward, policy._denoise
            victim_in = [False]

            def denoise(calls):
                victim_in[0] = any(c.observation is victim_obs for c in calls)
                return real_denoise(calls)

            def forward(x, *args, **kwargs):
                if kwargs.get("action") is not None and victim_in[0]:  # rank 1's forward fails mid-denoise; rank 0's does not
                    raise RuntimeError("rank 1: denoise forward failed")
                return real_forward(x, *args, **kwargs)

            policy._denoise, dit.forward = denoise, forward

    replies = run_ranks(tiny_model, sabotage, calls)
    by_rank = {}
    for r in (0, 1):
        first, second, open_sessions = replies[r]
        assert all(isinstance(x, InferReply) for x in first)
        by_rank[r] = {x.request_id: x for x in second}  # 10: a, 11: the victim, 12: c
        assert isinstance(by_rank[r][11], ErrorReply) and by_rank[r][11].kind is ErrorKind.POLICY
        assert isinstance(by_rank[r][10], InferReply) and isinstance(by_rank[r][12], InferReply)
        assert open_sessions == ["a", "c"]
    assert "rank 1:" in by_rank[1][11].message
    assert "other CFG-parallel rank" in by_rank[0][11].message  # rank 0 replies, and says where it failed
    for rid in (10, 12):
        assert np.array_equal(by_rank[0][rid].actions, by_rank[1][rid].actions)


@pytest.mark.parametrize("where", ["after_guidance", "sampler_step"])
def test_a_failure_after_the_guidance_on_one_cfg_rank_fails_the_same_session_on_both(tiny_model, monkeypatch, where):
    """Rank 1 fails the victim's denoise after the forward's exchange: after the guidance (the CFG
    arithmetic of a step) or in a sampler step, at the third step. Both ranks fail the victim and only
    it, the bystanders keep their sessions, and no rank waits for the other. Before: the per-step
    agreement covered the forward only, so rank 0 went on into the next step's collectives while
    rank 1 was in the phase's; their collectives paired up wrongly until a barrier timed out and the
    bystanders' sessions ended on both ranks."""
    rollouts = {sid: list(observations(2, seed=n)) for n, sid in enumerate(("a", "victim", "c"))}
    calls = [[(sid, obs[k]) for sid, obs in rollouts.items()] for k in range(2)]
    victim_obs = rollouts["victim"][1]
    rank1 = {"thread": None, "victim_in": False, "steps": 0}

    def sabotage(rank: int, policy) -> None:
        if rank != 1:
            return
        rank1["thread"] = threading.get_ident()
        real_denoise, real_guide = policy._denoise, policy._guide

        def denoise(calls):
            rank1["victim_in"], rank1["steps"] = any(c.observation is victim_obs for c in calls), 0
            return real_denoise(calls)

        def guide(calls, local):
            real_guide(calls, local)
            rank1["steps"] += 1
            if where == "after_guidance" and rank1["victim_in"] and rank1["steps"] == 3:
                raise RuntimeError("rank 1: guidance failed")

        policy._denoise, policy._guide = denoise, guide

    real_step = FlowUniPCSampler.step

    def step(self, model_output, sample, index, *args, **kwargs):
        if where == "sampler_step" and threading.get_ident() == rank1["thread"] and rank1["victim_in"] and index == 2:
            raise RuntimeError("rank 1: sampler step failed")
        return real_step(self, model_output, sample, index, *args, **kwargs)

    monkeypatch.setattr(FlowUniPCSampler, "step", step)
    pair = ThreadPair(barrier_timeout_s=20.0)
    started = time.monotonic()
    replies = run_ranks(tiny_model, sabotage, calls, pair)
    assert not pair.barrier.broken and time.monotonic() - started < 120.0
    by_rank = {}
    for r in (0, 1):
        first, second, open_sessions = replies[r]
        assert all(isinstance(x, InferReply) for x in first)
        by_rank[r] = {x.request_id: x for x in second}  # 10: a, 11: the victim, 12: c
        assert isinstance(by_rank[r][11], ErrorReply) and by_rank[r][11].kind is ErrorKind.POLICY, by_rank[r][11]
        assert isinstance(by_rank[r][10], InferReply) and isinstance(by_rank[r][12], InferReply), (by_rank[r][10], by_rank[r][12])
        assert open_sessions == ["a", "c"]
    assert "rank 1:" in by_rank[1][11].message
    assert "other CFG-parallel rank" in by_rank[0][11].message
    for rid in (10, 12):
        assert np.array_equal(by_rank[0][rid].actions, by_rank[1][rid].actions)


# -- warm-up ---------------------------------------------------------------------------------


def test_warmup_walks_every_batch_size_when_shapes_compile_and_restores_the_pool():
    policy = FakePolicy(FakeConfig(max_batch=3), RuntimeOptions())
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=4 * spec.pages_per_branch + 1, max_sessions=4, branches=policy.branches, max_batch=3)
    engine = SessionEngine(policy, cache, max_sessions=4, max_batch=3, warmup_batches=3)
    timings = engine.warmup()
    assert list(timings) == ["call1_ms", "batch2_call1_ms", "batch3_call1_ms"]
    assert engine.cache.pool.num_free == engine.cache.pool.capacity and not engine.sessions and not engine.batches


def test_compiled_batches_are_compiled_at_warm_up_not_while_robots_wait(tiny_model):
    """engine.compile: every batch shape up to engine.max_batch is traced during warm-up; a batch
    of two robots afterwards compiles nothing (before: warm-up traced batch size 1 only)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
    from tests.helpers.dreamzero import TINY

    counter = CompileCounter()
    torch._dynamo.reset()
    options = RuntimeOptions(compile=True, compile_backend=counter, max_batch=2)
    policy = DreamZeroPolicy(DreamZeroConfig(**TINY), options, model=copy.deepcopy(tiny_model))
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * 2 * spec.pages_per_branch + 1, max_sessions=2, max_batch=2)
    engine = SessionEngine(policy, cache, max_sessions=2, max_batch=2, warmup_batches=2)
    engine.warmup()
    traced = counter.frame_count
    assert traced > 0
    for k, obs in enumerate(observations(3)):
        replies = engine.run([Infer(2 * k, "a", obs), Infer(2 * k + 1, "b", obs)])
        assert all(isinstance(r, InferReply) and r.batch_size == 2 for r in replies)
    assert counter.frame_count == traced, "a batch shape was compiled while robots waited"
