"""Zero-WAM's episode logic (policies/lingbot_va/zero_wam_episode.py) on the tiny checkpoint, against upstream's rules.

* the forwards a chunk runs are upstream's (``_cache_icl_context``, ``_infer_icl``, ``_compute_icl_kv_cache``): which
  branch (CFG half), frame id, whether the pinned block is seen, what is kept;
* what the cache holds after every call is what upstream's cache holds (tests/helpers/zero_wam_cache.py, the metadata
  oracle): the demonstration pinned in the conditional half, predictions dropped exactly when upstream drops them,
  the unconditional half without action history, the window trimmed by frame ids;
* noise is drawn as upstream draws it (video, actions, and one discarded draw of the actions' shape), seeded per session;
* several robots batched equal each alone (<= 1e-5); a failed call, lone or batched, leaves its session as it was; a
  bad request is refused by name before the session changes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from ardiff_kv import Branch, EntryKind, PagedKVCache, SessionKV
from ardiff_policies.episode import EpisodeStart
from ardiff_policies.lingbot_va.embodiments import ZERO_WAM_ROBOTWIN
from ardiff_policies.lingbot_va.episode_io import EpisodeError
from ardiff_policies.lingbot_va.zero_wam_checkpoint import ZeroWAMConfig
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationGeometry
from ardiff_policies.lingbot_va.zero_wam_episode import CommitRequest, InferRequest, ZeroWAMEpisodes, kv_spec
from ardiff_policies.lingbot_va.zero_wam_tiny import (
    TINY_DEMONSTRATIONS,
    TINY_ZERO_WAM,
    TINY_ZERO_WAM_EMBODIMENT,
    ensure_tiny_demonstrations,
    ensure_tiny_zero_wam_checkpoint,
)
from tests.helpers.zero_wam_cache import ICL, OBSERVATION, PREDICTION, VIDEO, Episode

PROMPT = "grab the white mug"
ICL_START = EpisodeStart(True, "tiny/wave", -1.0, 5.0)  # upstream's client's defaults: empty target text, ICL CFG 5
TEXT_START = EpisodeStart(False, None, 5.0, 5.0)  # text CFG
NONE_START = EpisodeStart(False, None, -1.0, 5.0)  # one half
V, A = 3, 8  # the tiny chunk's pages: 12 video tokens, 32 action tokens, pages of 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def policy() -> ZeroWAMEpisodes:
    return ZeroWAMEpisodes.load(
        ensure_tiny_zero_wam_checkpoint(),
        TINY_ZERO_WAM_EMBODIMENT,
        demonstrations=TINY_DEMONSTRATIONS,
        demonstration_root=ensure_tiny_demonstrations(),
    )


def make_cache(policy, sessions: int = 3, spare: int = 0) -> PagedKVCache:
    spec = policy.kv_spec()
    pages = sessions * spec.reservation(2) + PagedKVCache.undo_headroom(spec, 2, sessions) + spare + 1
    return PagedKVCache(spec, num_pages=pages, max_sessions=sessions, attention_backend="sdpa", max_batch=sessions)


def frames(seed: int, count: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    e = TINY_ZERO_WAM_EMBODIMENT
    return [{camera: rng.integers(0, 256, (40, 72, 3), dtype=np.uint8) for camera in e.cameras} for _ in range(count)]


def key_frames(chunk: int, seed: int) -> list[dict]:
    return frames(1000 * seed + chunk, 4 * (2 - (chunk == 0)))


def started(policy, cache, name: str, start: EpisodeStart = ICL_START, seed: int = 1):
    session = policy.start_session(name, cache.open_session(name))
    policy.begin(session, PROMPT, start, seed)
    return session


def layout(session) -> dict:
    """Everything of a session a call may change."""
    return {
        "entries": {b: list(session.kv.branch(b).entries) for b in Branch},
        "frames": {b: dict(session.kv.branch(b).frames) for b in Branch},
        "generator": session.generator.get_state(),
        "stream": [None if c is None else c.clone() for c in session.streams[0].feat_cache],
        "counters": (session.chunk, session.predictions, session.served),
        "tensors": (session.init_latent, session.action_history),
    }


def assert_same_layout(a: dict, b: dict) -> None:
    assert a["entries"] == b["entries"] and a["frames"] == b["frames"] and a["counters"] == b["counters"]
    assert torch.equal(a["generator"], b["generator"])
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a["stream"], b["stream"]))
    assert all(x is y for x, y in zip(a["tensors"], b["tensors"]))


def test_the_page_holds_whole_demonstration_frames():
    """The page divides a demonstration frame's tokens as well as a chunk's: a demonstration of the geometry's frame size
    is whole pages whatever its frame count. 4x6 latent frames (the parity recording's): chunks of 12 video and 32 action
    tokens, demonstration frames of 6 tokens -> pages of 2 (gcd(12, 32) = 4 refused a 3-frame, 18-token demonstration).
    At full size nothing changes: gcd(378, 32, 150) = 2."""
    e = dataclasses.replace(TINY_ZERO_WAM_EMBODIMENT, height=64, width=32)
    geometry = DemonstrationGeometry(latent_size=(4, 6), max_frames=3)
    spec = kv_spec(e, TINY_ZERO_WAM, geometry, torch.float32)
    assert (spec.page_size, spec.max_pinned_pages) == (2, 9)
    assert kv_spec(TINY_ZERO_WAM_EMBODIMENT, TINY_ZERO_WAM, TINY_DEMONSTRATIONS, torch.float32).page_size == 4  # the tiny server's: unchanged
    assert kv_spec(ZERO_WAM_ROBOTWIN, ZeroWAMConfig(), DemonstrationGeometry(), torch.bfloat16).page_size == 2


# -- upstream's forwards and cache ---------------------------------------------------------------


def test_a_chunk_runs_upstreams_forwards(policy, monkeypatch):
    """Per forward: the branch, its frame id, whether it sees the pinned block, what it keeps. Video steps in both
    halves (2 + the trailing t = 0 one keeping the prediction), action steps over the conditional branch without the
    block keeping nothing (no trailing one), then the commit's video in both halves and the history in the conditional."""
    calls = []
    original = SessionKV.begin_forward

    def spy(self, branch, **kwargs):
        entry = kwargs.get("entry", EntryKind.OBSERVATION) if kwargs.get("commit") else None
        calls.append((Branch(branch).name, kwargs.get("frame"), kwargs.get("attend_pinned", True), entry, kwargs["num_video_tokens"] // 4))
        return original(self, branch, **kwargs)

    monkeypatch.setattr(SessionKV, "begin_forward", spy)
    cache = make_cache(policy, 1)
    session = started(policy, cache, "a")
    assert calls == [("COND", None, True, EntryKind.IN_CONTEXT, 2)]  # the demonstration: 2 latent frames of 4x4 = 2 pages
    calls.clear()
    policy.infer(session, frames(0, 1)[0])
    video_step = [("COND", 0, True, None, V), ("UNCOND", 0, True, None, V)]
    action_step = [("COND", 1, False, None, A)]
    keep = [("COND", 0, True, EntryKind.PREDICTION, V), ("UNCOND", 0, True, EntryKind.PREDICTION, V)]
    assert calls == video_step * 2 + keep + action_step * 2
    calls.clear()
    policy.compute_kv_cache(session, key_frames(0, 1))
    assert calls == [
        ("COND", 0, True, EntryKind.OBSERVATION, V),
        ("UNCOND", 0, True, EntryKind.OBSERVATION, V),
        ("COND", 1, False, EntryKind.OBSERVATION, A),
    ]
    calls.clear()
    policy.infer(session, [])  # a later chunk reads no observation
    assert [c[1] for c in calls] == [2, 2, 2, 2, 2, 2, 3, 3]


def _held(session) -> dict:
    """Per half: (what, frame) -> pages, of what the session's branches hold."""
    out = {}
    for seq, branch in enumerate(Branch):
        state = session.kv.branch(branch)
        held = Counter({(ICL, 0): len(state.pinned)} if state.pinned else {})
        for page in state.resident:
            frame = state.frames[page]
            held[(OBSERVATION, frame)] += 1
        for page in state.provisional:
            held[(PREDICTION, state.frames[page])] += 1
        out[seq] = held
    return out


def _oracle(episode: Episode, demo_pages: int) -> dict:
    out = {0: Counter(), 1: Counter()}
    for e in episode.entries:
        pages = demo_pages if e.cache_type == ICL else (V if e.kind == VIDEO else A)
        out[e.seq][(e.cache_type, e.frame)] += pages
    return out


@pytest.mark.parametrize(("start", "cfg", "demonstration"), [(ICL_START, True, True), (TEXT_START, True, False), (NONE_START, False, False)])
def test_the_cache_holds_what_upstreams_holds_after_every_call(policy, start, cfg, demonstration):
    """The oracle's bookkeeping (upstream's cache types, halves and frame ids, its clear_prediction_cache) against the
    pages the policy's session holds, after every call of an episode with a repeated infer: predictions are kept until
    the commit (a repeated infer's stacked on the first's, as upstream), dropped by it, never written by the action loop."""
    cache = make_cache(policy, 1)
    session = started(policy, cache, "a", start)
    oracle = Episode(window=policy.transformer.config.attn_window, cfg=cfg)
    oracle.reset(demonstration=demonstration)
    assert _held(session) == _oracle(oracle, 2)
    for chunk in range(5):
        policy.infer(session, frames(chunk, 1)[0] if chunk == 0 else [])
        oracle.infer()
        assert _held(session) == _oracle(oracle, 2), f"after chunk {chunk}'s infer"
        if chunk == 2:
            policy.infer(session, [])  # asked again before the commit
            oracle.infer()
            assert _held(session) == _oracle(oracle, 2)
        policy.compute_kv_cache(session, key_frames(chunk, 1))
        oracle.compute_kv_cache()
        assert _held(session) == _oracle(oracle, 2), f"after chunk {chunk}'s commit"
    cache.end_session(session.kv)
    assert cache.pool.num_allocated == 0


def test_noise_is_upstreams_draws_from_the_session_generator(policy):
    """Per infer: the video, the actions, and one more draw of the actions' shape that is discarded (upstream's
    randn_like), from the generator seeded at reset: the same seed, the same episode."""
    cache = make_cache(policy, 2)
    e = TINY_ZERO_WAM_EMBODIMENT
    a = started(policy, cache, "a", seed=7)
    first = policy.infer(a, frames(0, 1)[0])
    generator = torch.Generator().manual_seed(7)
    torch.randn(1, 48, 2, *e.latent_size, generator=generator)
    for _ in range(2):
        torch.randn(1, 30, 2, 16, 1, generator=generator)
    assert torch.equal(a.generator.get_state(), generator.get_state())
    b = started(policy, cache, "b", seed=7)
    np.testing.assert_array_equal(policy.infer(b, frames(0, 1)[0]), first)
    policy.begin(b, PROMPT, ICL_START, 8)
    assert np.abs(policy.infer(b, frames(0, 1)[0]) - first).max() > 1e-4


# -- several robots, failures, refusals ------------------------------------------------------------


def _episode(policy, cache, name, start, seed, chunks):
    session = started(policy, cache, name, start, seed)
    out = []
    for chunk in range(chunks):
        out.append(policy.infer(session, frames(seed + chunk, 1)[0] if chunk == 0 else []))
        policy.compute_kv_cache(session, key_frames(chunk, seed))
    return out


def test_several_robots_batched_equal_each_alone(policy):
    """In-context guidance, text guidance and one half in one batch (each session its own rows, texts, scale, pages)."""
    starts = {"icl": (ICL_START, 1), "text": (TEXT_START, 2), "none": (NONE_START, 3)}
    alone = {name: _episode(policy, make_cache(policy, 1), name, start, seed, 3) for name, (start, seed) in starts.items()}
    cache = make_cache(policy, 3)
    sessions = {name: started(policy, cache, name, start, seed) for name, (start, seed) in starts.items()}
    for chunk in range(3):
        requests = [InferRequest(s, frames(starts[n][1] + chunk, 1)[0] if chunk == 0 else []) for n, s in sessions.items()]
        for name, got in zip(sessions, policy.infer_batch(requests)):
            np.testing.assert_allclose(got, alone[name][chunk], atol=ATOL, rtol=0)
        commits = [CommitRequest(s, key_frames(chunk, starts[n][1])) for n, s in sessions.items()]
        assert policy.compute_kv_cache_batch(commits) == [None] * 3
    assert {n: len(s.kv.branch(Branch.COND).pinned) for n, s in sessions.items()} == {"icl": 2, "text": 0, "none": 0}
    assert not sessions["none"].kv.branch(Branch.UNCOND).held  # one half: the unconditional branch is never written


class Boom(RuntimeError):
    pass


def _fail_when(policy, monkeypatch, predicate):
    """The transformer raises on a forward ``predicate(x, action_mode, calls)`` picks."""
    original = type(policy.transformer).forward
    calls = []

    def forward(self, x, *args, action_mode, **kwargs):
        calls.append(action_mode)
        if predicate(x, action_mode, len(calls)):
            raise Boom("a forward failed")
        return original(self, x, *args, action_mode=action_mode, **kwargs)

    monkeypatch.setattr(type(policy.transformer), "forward", forward)


@pytest.mark.parametrize("where", ["infer's trailing forward", "infer's action loop", "the commit's action forward"])
def test_a_failed_lone_call_leaves_the_session_as_it_was(policy, monkeypatch, where):
    cache = make_cache(policy, 2)
    twin = _episode(policy, make_cache(policy, 1), "twin", ICL_START, 4, 3)
    session = started(policy, cache, "a", seed=4)
    policy.infer(session, frames(4, 1)[0])
    policy.compute_kv_cache(session, key_frames(0, 4))
    before, free = layout(session), cache.pool.num_free
    if where == "the commit's action forward":
        np.testing.assert_allclose(policy.infer(session, []), twin[1], atol=ATOL, rtol=0)
        before, free = layout(session), cache.pool.num_free
        _fail_when(policy, monkeypatch, lambda x, action_mode, n: action_mode)
        with pytest.raises(Boom):
            policy.compute_kv_cache(session, key_frames(1, 4))
    else:
        nth = 3 if where == "infer's trailing forward" else 4  # video steps 1, 2, the trailing 3, then actions
        _fail_when(policy, monkeypatch, lambda x, action_mode, n: n == nth)
        with pytest.raises(Boom):
            policy.infer(session, [])
    assert_same_layout(layout(session), before)
    assert cache.pool.num_free == free
    monkeypatch.undo()
    if where == "the commit's action forward":
        policy.compute_kv_cache(session, key_frames(1, 4))
        np.testing.assert_allclose(policy.infer(session, []), twin[2], atol=ATOL, rtol=0)
    else:  # the retry is the chunk it would have been
        np.testing.assert_allclose(policy.infer(session, []), twin[1], atol=ATOL, rtol=0)


def test_a_failed_batch_is_retried_member_by_member_and_a_member_that_fails_alone_is_put_back(policy, monkeypatch):
    alone = {seed: _episode(policy, make_cache(policy, 1), str(seed), ICL_START, seed, 2) for seed in (5, 6)}
    cache = make_cache(policy, 2)
    good, bad = started(policy, cache, "good", seed=5), started(policy, cache, "bad", seed=6)
    for session, seed in ((good, 5), (bad, 6)):
        policy.infer(session, frames(seed, 1)[0])
        policy.compute_kv_cache(session, key_frames(0, seed))
    before, free = layout(bad), cache.pool.num_free
    bad_rows = {id(bad)}

    # a forward holding the bad session's rows fails: the batch and its retry of that member, not the good one alone
    def predicate(x, action_mode, n):
        return any(id(s) in bad_rows for s in holder.sessions)

    class Holder:
        sessions = ()

    holder = Holder()
    original = ZeroWAMEpisodes._forward

    def forward(self, rows, *args, **kwargs):
        holder.sessions = [row.session for row in rows]
        return original(self, rows, *args, **kwargs)

    monkeypatch.setattr(ZeroWAMEpisodes, "_forward", forward)
    _fail_when(policy, monkeypatch, predicate)
    out = policy.infer_batch([InferRequest(good, []), InferRequest(bad, [])])
    np.testing.assert_allclose(out[0], alone[5][1], atol=ATOL, rtol=0)
    assert isinstance(out[1], Boom)
    assert_same_layout(layout(bad), before)
    monkeypatch.undo()
    np.testing.assert_allclose(policy.infer(bad, []), alone[6][1], atol=ATOL, rtol=0)
    for s in (good, bad):
        cache.end_session(s.kv)
    assert cache.pool.num_free == cache.pool.capacity and free < cache.pool.capacity


def test_bad_requests_are_refused_by_name_before_the_session_changes(policy):
    cache = make_cache(policy, 2)
    fresh = policy.start_session("fresh", cache.open_session("fresh"))
    with pytest.raises(EpisodeError, match="infer before reset"):
        policy.infer(fresh, frames(0, 1)[0])
    for start, match in (
        (EpisodeStart(True, None), "icl_demo_id: missing; use_icl is true"),
        (EpisodeStart(True, "tiny/nothing"), "no nothing.pth under the demonstration root"),
        (EpisodeStart(True, "tiny/wave", 30.0), r"video_guidance_scale: 30\.0 outside"),
    ):
        with pytest.raises(EpisodeError, match=match):
            policy.begin(fresh, PROMPT, start, 1)
    with pytest.raises(EpisodeError, match="prompt: Zero-WAM's episode needs the task's prompt"):
        policy.begin(fresh, " ", ICL_START, 1)
    assert fresh.plan is None and fresh.kv.pages_held == 0
    session = started(policy, cache, "a")
    before = layout(session)
    with pytest.raises(EpisodeError, match=r"no nothing\.pth"):  # a bad reset of a running episode changes nothing either
        policy.begin(session, PROMPT, EpisodeStart(True, "tiny/nothing"), 1)
    with pytest.raises(EpisodeError, match="compute_kv_cache before the episode's first infer"):
        policy.compute_kv_cache(session, key_frames(0, 1))
    with pytest.raises(EpisodeError, match="the first infer of an episode takes one observation, got 2"):
        policy.infer(session, frames(0, 2))
    with pytest.raises(EpisodeError, match=r"camera 'observation\.images\.cam_left_wrist' missing"):
        policy.infer(session, {"observation.images.cam_high": frames(0, 1)[0]["observation.images.cam_high"]})
    assert_same_layout(layout(session), before)
    policy.infer(session, frames(0, 1)[0])
    policy.infer(session, frames(0, 1)[0])  # upstream stacks a second prediction
    before = layout(session)
    with pytest.raises(EpisodeError, match="chunk 0 was predicted 2 times without its compute_kv_cache"):
        policy.infer(session, frames(0, 1)[0])
    with pytest.raises(EpisodeError, match="obs: 8 key frames; this chunk takes 4"):
        policy.compute_kv_cache(session, key_frames(1, 1))
    assert_same_layout(layout(session), before)
    policy.compute_kv_cache(session, key_frames(0, 1))
    assert session.chunk == 1 and session.predictions == 0


def test_a_failed_demonstration_forward_leaves_the_session_not_begun(policy, monkeypatch):
    cache = make_cache(policy, 1)
    session = policy.start_session("a", cache.open_session("a"))
    _fail_when(policy, monkeypatch, lambda x, action_mode, n: True)
    with pytest.raises(Boom):
        policy.begin(session, PROMPT, ICL_START, 1)
    assert session.plan is None and session.kv.pages_held == 0 and cache.pool.num_free == cache.pool.capacity
