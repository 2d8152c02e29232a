"""LingBot-VA's per-request denoising steps (``num_inference_steps``: the video loop, ``action_num_inference_steps``:
the action loop; ``ardiff_policies.inference_steps``): a call asking for fewer steps denoises exactly as an embodiment
configured for them and runs fewer transformer forwards; a batch mixing step counts runs one batched call per count
(never one schedule for all) and each member equals itself alone; steps outside the deployment's bounds are refused by
name with the session untouched, a config bound widens them; the reply says the steps it ran."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ardiff_policies.episode import EpisodeCall
from ardiff_policies.inference_steps import StepBounds
from ardiff_policies.lingbot_va.episode import EpisodeError, InferRequest, LingBotVAEpisodes
from ardiff_policies.lingbot_va.tiny import TINY_EMBODIMENT, ensure_tiny_checkpoint
from ardiff_policies.observation import RobotObservation
from ardiff_server.config import load_config
from ardiff_server.engine.builder import build_engine
from ardiff_server.engine.messages import ErrorKind, ErrorReply, Infer
from tests.helpers.lingbot_va import ATOL, make_cache
from tests.helpers.scripts import load_script

RECORD = load_script("record_upstream_lingbot_va")  # its observation and key-frame functions
PROMPT = "stack the cube"
CONFIGURED = (TINY_EMBODIMENT.num_inference_steps, TINY_EMBODIMENT.action_num_inference_steps)  # (2, 2)


@pytest.fixture(scope="module")
def policy() -> LingBotVAEpisodes:
    return LingBotVAEpisodes.load(ensure_tiny_checkpoint(), TINY_EMBODIMENT)


class Forwards:
    """Counts the transformer's forwards (one per batched forward, whatever the batch)."""

    def __init__(self, policy: LingBotVAEpisodes) -> None:
        self.count = 0
        self._handle = policy.transformer.register_forward_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count

    def close(self) -> None:
        self._handle.remove()


def episode(policy: LingBotVAEpisodes, sid: str, steps: dict, chunks: int = 2, seed: int = 0) -> tuple[list, list]:
    """``chunks`` x (infer asking ``steps``, commit of its key frames); each infer's actions and forwards."""
    cache = make_cache(policy)
    session = policy.start_session(sid, cache.open_session(sid))
    policy.reset(session, PROMPT, seed=seed)
    forwards = Forwards(policy)
    actions, counts = [], []
    try:
        for index in range(chunks):
            actions.append(policy.infer(session, RECORD.observation(TINY_EMBODIMENT.cameras, index + seed), **steps))
            counts.append(forwards.take())
            assert (session.last.video_steps, session.last.action_steps, session.last.forwards) == (
                steps.get("num_inference_steps", policy.embodiment.num_inference_steps),
                steps.get("action_num_inference_steps", policy.embodiment.action_num_inference_steps),
                counts[-1],
            )
            frames = RECORD.key_frames(TINY_EMBODIMENT.cameras, index + seed, 4 * (TINY_EMBODIMENT.frame_chunk_size - (index == 0)))
            policy.compute_kv_cache(session, frames, actions[-1])
            assert forwards.take() == 2  # a commit: one video and one action forward, whatever the steps
    finally:
        forwards.close()
    return actions, counts


@pytest.mark.parametrize(("steps", "forwards"), [({"num_inference_steps": 1}, 2 + 3), ({"action_num_inference_steps": 1}, 3 + 2)])
def test_fewer_steps_denoise_as_an_embodiment_configured_for_them_with_fewer_forwards(policy, steps, forwards):
    """Asked per call, 1 video (or action) step gives exactly what an embodiment configured with 1 gives, in one
    forward fewer per loop (each loop: its steps and the trailing t = 0 forward that keeps the chunk's K/V)."""
    configured = dataclasses.replace(
        TINY_EMBODIMENT,
        num_inference_steps=steps.get("num_inference_steps", CONFIGURED[0]),
        action_num_inference_steps=steps.get("action_num_inference_steps", CONFIGURED[1]),
    )
    reference = LingBotVAEpisodes(policy.transformer, policy.vae, policy.text_encoder, policy.tokenizer, configured)
    asked, asked_forwards = episode(policy, "asked", steps)
    expected, expected_forwards = episode(reference, "configured", {})
    default, default_forwards = episode(policy, "default", {})
    for a, e, d in zip(asked, expected, default, strict=True):
        np.testing.assert_array_equal(a, e)
        assert np.abs(a - d).max() > 1e-3  # it did run another schedule
    assert asked_forwards == expected_forwards == [forwards] * 2
    assert default_forwards == [sum(CONFIGURED) + 2] * 2  # the configured 2 + 2 steps: 6 forwards


def test_a_batch_mixing_step_counts_runs_one_call_per_count_and_each_equals_itself_alone(policy):
    """Three sessions in one infer_batch, two asking (1, 1) and one the configured (2, 2): one batched call of 4
    forwards for the first two, one of 6 for the third (10 in all: never one schedule forced on all), every member's
    chunk its own alone."""
    asks = {
        "a": {"num_inference_steps": 1, "action_num_inference_steps": 1},
        "b": {},
        "c": {"num_inference_steps": 1, "action_num_inference_steps": 1},
    }
    alone = {sid: episode(policy, sid, steps, chunks=1, seed=k)[0][0] for k, (sid, steps) in enumerate(asks.items())}
    cache = make_cache(policy, sessions=3)
    sessions = {}
    for sid in asks:
        sessions[sid] = policy.start_session(sid, cache.open_session(sid))
        policy.reset(sessions[sid], PROMPT, seed=list(asks).index(sid))
    requests = [
        InferRequest(
            sessions[sid],
            RECORD.observation(TINY_EMBODIMENT.cameras, k),
            num_inference_steps=steps.get("num_inference_steps"),
            action_num_inference_steps=steps.get("action_num_inference_steps"),
        )
        for k, (sid, steps) in enumerate(asks.items())
    ]
    forwards = Forwards(policy)
    try:
        together = policy.infer_batch(requests)
    finally:
        forwards.close()
    assert forwards.count == 4 + 6
    for (sid, steps), actions in zip(asks.items(), together, strict=True):
        assert not isinstance(actions, Exception), actions
        np.testing.assert_allclose(actions, alone[sid], atol=ATOL, rtol=0)
        last = sessions[sid].last
        assert (last.video_steps, last.action_steps) == (steps.get("num_inference_steps", 2), steps.get("action_num_inference_steps", 2))


def test_the_episode_logic_refuses_steps_that_are_no_step_count_and_leaves_the_session(policy):
    cache = make_cache(policy)
    session = policy.start_session("bad", cache.open_session("bad"))
    policy.reset(session, PROMPT, seed=0)
    observation = RECORD.observation(TINY_EMBODIMENT.cameras, 0)
    for key, bad in (("num_inference_steps", 0), ("action_num_inference_steps", 1001), ("num_inference_steps", 2.0)):
        with pytest.raises(EpisodeError, match=rf"^{key}: expected an integer in \[1, 1000\], got {bad!r}$"):
            policy.infer(session, observation, **{key: bad})
        assert (session.chunks, session.last, session.frame_start) == (0, None, 0)
    policy.infer(session, observation, num_inference_steps=3)  # the episode logic takes any count; bounds are the deployment's
    assert session.last.video_steps == 3


# ----------------------------------------------------------------------------- through the engine


def cameras(engine, frames: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    served = engine.policy
    return {name: rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for name, (h, w) in zip(served.cameras, served.schema.resolutions)}


def openpi(engine, frames: int, seed: int, **steps) -> RobotObservation:
    return RobotObservation(cameras(engine, frames, seed), {}, PROMPT, **steps)


def test_the_deployment_bounds_refuse_by_name_and_a_config_bound_widens_them():
    engine = build_engine(load_config("tiny_lingbot_va", overrides=["engine.warmup=false", "policy.request_action_inference_steps=[1,4]"]))
    try:
        served = engine.policy
        assert served.info.inference_steps == {
            "num_inference_steps": StepBounds(1, 2, "policy.request_inference_steps"),
            "action_num_inference_steps": StepBounds(1, 4, "policy.request_action_inference_steps"),
        }
        assert served.info.describe()["inference_steps"]["action_num_inference_steps"] == {
            "min": 1,
            "max": 4,
            "setting": "policy.request_action_inference_steps",
        }
        first = engine.infer("s", openpi(engine, 1, 1, num_inference_steps=1)).result
        assert (first.info["num_inference_steps"], first.info["action_num_inference_steps"], first.info["dit_forwards"]) == (1, 2, 5)
        state = engine.sessions["s"].policy_state.episode
        before = (state.chunks, state.last, state.frame_start, state.kv.pages_held)
        refusals = {
            "num_inference_steps": (3, "num_inference_steps: 3 is above the maximum 2 this server takes (policy.request_inference_steps: [1, 2])"),
            "action_num_inference_steps": (
                5,
                "action_num_inference_steps: 5 is above the maximum 4 this server takes (policy.request_action_inference_steps: [1, 4])",
            ),
        }
        for key, (value, message) in refusals.items():
            (reply,) = engine.run([Infer(1, "s", openpi(engine, 4, 2, **{key: value}))])
            assert isinstance(reply, ErrorReply) and reply.kind is ErrorKind.BAD_REQUEST and reply.message == message
        assert (state.chunks, state.last, state.frame_start, state.kv.pages_held) == before  # refused before anything changed
        wider = engine.infer("s", openpi(engine, 4, 2, action_num_inference_steps=4)).result  # more than configured: the config says so
        assert (wider.info["num_inference_steps"], wider.info["action_num_inference_steps"], wider.info["dit_forwards"]) == (2, 4, 8)
        native = engine.infer("n", RobotObservation(cameras(engine, 1, 3), {}, PROMPT, EpisodeCall("infer"), action_num_inference_steps=1)).result
        assert (native.info["num_inference_steps"], native.info["action_num_inference_steps"]) == (2, 1)
        plain = engine.infer("p", openpi(engine, 1, 4)).result  # none asked: the embodiment's, as upstream's
        assert (plain.info["num_inference_steps"], plain.info["action_num_inference_steps"], plain.info["dit_forwards"]) == (2, 2, 6)
        for sid in ("s", "n", "p"):
            engine.end(sid, "test")
        assert engine.cache.pool.num_free == engine.cache.pool.capacity
    finally:
        engine.close()
