"""engine.modelled_step_time: bench configs only; a step lasts at least t(b) and returns what the real step returned."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ardiff_server.config import ConfigError, load_config, validate_config
from ardiff_server.engine.modelled_step import ModelledStepPolicy, step_time_profile
from tests.helpers.server_harness import droid_observation


def tiny(engine: dict, **top) -> dict:
    return {
        "engine": {"warmup": False, "kv_budget_gib": 0.1, "max_sessions": 3, **engine},
        "policy": {"name": "dreamzero", "view_size": [48, 80]},
        **top,
    }


def test_the_modelled_step_time_is_refused_in_a_normal_config_with_one_line_naming_it_and_the_fix():
    with pytest.raises(ConfigError) as refused:
        validate_config(tiny({"modelled_step_time": "14b"}), source="configs/tiny.yaml")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("configs/tiny.yaml: engine.modelled_step_time ") and "bench-only" in message and "bench: true" in message
    with pytest.raises(ConfigError, match=r"engine\.modelled_step_time \(from --set engine\.modelled_step_time=5b\) is bench-only"):
        load_config("tiny", ["engine.modelled_step_time=5b"])
    with pytest.raises(ConfigError, match=r"engine\.modelled_step_t1_s .*needs engine\.modelled_step_time"):
        validate_config(tiny({"modelled_step_t1_s": 0.2}, bench=True))
    with pytest.raises(ConfigError, match="modelled_step_time"):  # only the two profiles
        validate_config(tiny({"modelled_step_time": "7b"}, bench=True))
    assert validate_config(tiny({"modelled_step_time": "14b"}, bench=True)).engine.modelled_step_time == "14b"
    assert not validate_config(tiny({})).bench  # a config is no bench config unless it says so


def test_the_profiles_follow_the_roofline():
    big, small = step_time_profile("14b"), step_time_profile("5b")
    assert [big.seconds(b) for b in (1, 2, 4)] == pytest.approx([0.61, 1.22, 2.44])  # compute-bound: b t(1)
    assert [small.seconds(b) for b in (1, 2, 11)] == pytest.approx([0.15, 0.165, 0.30])  # t(1) (1 + 0.1 (b - 1))
    assert step_time_profile("5b", 0.4).seconds(3) == pytest.approx(0.48)
    with pytest.raises(ValueError, match="7b"):
        step_time_profile("7b")


def test_a_modelled_step_lasts_at_least_t_b_and_its_result_is_the_real_one():
    from ardiff_server.engine.builder import build_engine
    from ardiff_server.wire.decode import decode_request

    plain = build_engine(validate_config(tiny({"max_batch": 2})))
    t1 = 0.4  # above the tiny model's own step on a loaded CPU, so the sleep is what sets the time
    modelled = build_engine(validate_config(tiny({"max_batch": 2, "modelled_step_time": "5b", "modelled_step_t1_s": t1}, bench=True)))
    assert isinstance(modelled.policy, ModelledStepPolicy) and not isinstance(plain.policy, ModelledStepPolicy)
    assert modelled.policy.info == plain.policy.info and modelled.max_batch == plain.max_batch == 2

    def observe(call: int, robot: int):
        return decode_request(droid_observation(1 if call == 0 else 4, size=(90, 160), seed=10 * robot + call, joint0=0.1 * call)).observation

    for call in range(2):  # a window start, then a steady call
        # one session alone: t(1)
        started = time.perf_counter()
        alone = modelled.infer("alone", observe(call, 0))
        assert time.perf_counter() - started >= t1
        assert alone.compute_ms + alone.result.info["own_encode_ms"] >= 1000.0 * t1  # a window start's encode counts inside t(1)
        assert alone.result.info["modelled_step_ms"] == pytest.approx(1000.0 * t1)
        np.testing.assert_array_equal(alone.result.actions, plain.infer("alone", observe(call, 0)).result.actions)

    # two sessions in one step: t(2) = t1 x 1.1, each member's actions those of the unwrapped policy's batch
    def batch(engine):
        states = [engine.policy.start_session(f"pair-{r}", engine.cache.open_session(f"pair-{r}")) for r in range(2)]
        started = time.perf_counter()
        results = engine.policy.step_batch([(s, observe(0, 5 + r)) for r, s in enumerate(states)])
        return results, time.perf_counter() - started

    real, _ = batch(plain)
    results, took = batch(modelled)
    assert took >= 1.1 * t1
    for got, want in zip(results, real):
        np.testing.assert_array_equal(got.actions, want.actions)
        assert got.info["modelled_step_ms"] == pytest.approx(1100.0 * t1)
        # on a loaded CPU the real step may take longer than modelled: never shortened, and flagged
        assert took >= got.info["real_step_ms"] / 1000.0
        assert got.info["modelled_step_overrun"] is (got.info["real_step_ms"] > got.info["modelled_step_ms"])


def test_the_wrapper_sleeps_the_rest_of_t_b_and_never_shortens_a_longer_step():
    from ardiff_policies.base import RuntimeOptions, build_policy

    now = [0.0]
    slept: list[float] = []
    took = [0.2]
    inner = build_policy("noop", {"name": "noop"}, RuntimeOptions())
    real_step_batch = inner.step_batch

    def timed_step_batch(items):
        now[0] += took[0] * len(items)  # the real step, on the fake clock: its members one after another
        return real_step_batch(items)

    inner.step_batch = timed_step_batch
    policy = ModelledStepPolicy(inner, step_time_profile("14b"), clock=lambda: now[0], sleep=slept.append)
    session = policy.start_session("s", None)
    fast = policy.step(session, None)
    assert slept == [pytest.approx(0.41)] and fast.info["modelled_step_overrun"] is False
    pair = policy.step_batch([(session, None), (policy.start_session("t", None), None)])  # t(2) = 1.22 s for 0.4 s of steps
    assert slept[1] == pytest.approx(0.82) and all(r.info["modelled_step_ms"] == pytest.approx(1220.0) for r in pair)
    took[0] = 0.9
    slow = policy.step(session, None)
    assert slept[2] == 0.0 and slow.info["modelled_step_overrun"] is True
    assert slow.info["real_step_ms"] == pytest.approx(900.0) and slow.info["modelled_step_ms"] == pytest.approx(610.0)


def test_a_step_mixing_step_counts_lasts_each_groups_t_b_at_its_steps_one_after_the_other():
    """The calls' own denoising steps (each result's num_inference_steps) set the modelled time: a step of two calls at 4
    steps and one at the configured 16 lasts t(2) x share(4) + t(1), as DreamZero runs one group per count; a call
    that reports none (a noop, a failure) counts at 16."""
    from ardiff_policies.base import RuntimeOptions, StepResult, build_policy

    slept: list[float] = []
    inner = build_policy("noop", {"name": "noop"}, RuntimeOptions())
    steps = iter([[4, None, 4], [8], [None]])

    def reported_step_batch(items):
        return [StepResult(np.zeros((1, 1), np.float32), {}, {} if n is None else {"num_inference_steps": n}) for n in next(steps)]

    inner.step_batch = reported_step_batch
    big = step_time_profile("14b")
    policy = ModelledStepPolicy(inner, big, clock=lambda: 0.0, sleep=slept.append)
    mixed = policy.step_batch([(None, None)] * 3)
    assert slept[0] == pytest.approx(2 * 0.61 * big.step_share(4) + 0.61)
    assert all(r.info["modelled_step_ms"] == pytest.approx(1000.0 * slept[0]) for r in mixed)
    policy.step_batch([(None, None)])
    assert slept[1] == pytest.approx(0.61 * (0.07 + 0.93 * 7 / 9))  # 8 steps: 1 + 6 of upstream's 1 + 8 DiT forwards
    policy.step_batch([(None, None)])
    assert slept[2] == pytest.approx(0.61)


def test_a_calls_own_encode_counts_inside_its_modelled_time():
    """t(1) is a GPU's whole chunk: a call whose prepare job (a window start's encodes) ran before its step sleeps only
    what is left of t(b) after the encode and the step; the batch is charged its largest member's encode; an encode
    and a step longer than t(b) together are an overrun; a later call without a job sleeps the whole rest again."""
    from ardiff_policies.base import RuntimeOptions, build_policy

    now = [0.0]
    slept: list[float] = []
    inner = build_policy("noop", {"name": "noop"}, RuntimeOptions())
    real_step_batch = inner.step_batch

    def timed_step_batch(items):
        now[0] += 0.1
        return real_step_batch(items)

    inner.step_batch = timed_step_batch
    policy = ModelledStepPolicy(inner, step_time_profile("14b"), clock=lambda: now[0], sleep=slept.append)
    a, b = object(), object()  # two sessions (noop keeps no state of its own: any object serves)
    encodes = {id(a): 0.3, id(b): 0.45}
    inner.prepare = lambda session, observation: lambda: now.__setitem__(0, now[0] + encodes[id(session)])
    policy.prepare(a, None)()
    first = policy.step(a, None)
    assert slept == [pytest.approx(0.61 - 0.3 - 0.1)] and first.info["own_encode_ms"] == pytest.approx(300.0)
    assert first.info["modelled_step_overrun"] is False
    steady = policy.step(a, None)  # no job this time: the whole rest of t(1)
    assert slept[1] == pytest.approx(0.51) and steady.info["own_encode_ms"] == 0.0
    policy.prepare(a, None)()
    policy.prepare(b, None)()
    pair = policy.step_batch([(a, None), (b, None)])  # t(2) = 1.22 s, charged the larger encode
    assert slept[2] == pytest.approx(1.22 - 0.45 - 0.1) and all(r.info["own_encode_ms"] == pytest.approx(450.0) for r in pair)
    encodes[id(a)] = 0.6
    policy.prepare(a, None)()
    late = policy.step(a, None)  # 0.6 s of encode and 0.1 s of step: over t(1)
    assert slept[3] == 0.0 and late.info["modelled_step_overrun"] is True
