"""The safety gate's checks alone (ardiff_policies.safety): clamp and reject per check, frozen rows, start-up refusals."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.errors import StartRefused
from ardiff_policies.lingbot_va.config import LingBotVAConfig
from ardiff_policies.observation import UnsupportedObservation
from ardiff_policies.safety import SafetyConfig, SafetyGate, SafetyRejected, rejected_check

# A DROID-like embodiment: 2 joints and a gripper, each a position with a state of its name; plus a velocity key.
ACTIONS = {"joint": (0, 2), "gripper": (2, 3), "base_velocity": (3, 4)}
STATES = {"joint": (0, 2), "gripper": (2, 3)}
STATE = np.array([0.0, 0.0, 0.5])


def gate(mode: str, control_hz: float | None = 10.0, **limits) -> SafetyGate:
    config = SafetyConfig(mode=mode, control_hz=control_hz, limits=limits)
    return SafetyGate.build(config, embodiment="test_arm", actions=ACTIONS, states=STATES)


def chunk(rows) -> np.ndarray:
    return np.array([[*r, 0.0] for r in rows], dtype=np.float32)


def test_the_gate_is_off_by_default_and_builds_nothing():
    assert SafetyConfig().mode == "off"
    assert SafetyGate.build(SafetyConfig(), embodiment="test_arm", actions=ACTIONS, states=STATES) is None
    assert DreamZeroConfig().safety.mode == "off"


def test_clamp_first_limits_the_first_action_towards_the_state_and_says_by_how_much():
    g = gate("clamp", joint={"max_first_step": 0.1})
    out, report = g.apply(chunk([[0.25, -0.05, 0.5], [0.25, -0.05, 0.5]]), STATE)
    np.testing.assert_allclose(out[0, :2], [0.1, -0.05], atol=1e-7)
    np.testing.assert_allclose(out[1, :2], [0.25, -0.05])  # no step limit: the second action is the model's
    assert report["mode"] == "clamp"
    assert report["clamped"]["first"]["values"] == 1
    assert report["clamped"]["first"]["max_excess"] == pytest.approx(0.15, abs=1e-6)
    assert report["clamped"]["first"]["first_at"] == "joint[0] action 0"


def test_clamp_step_is_a_rate_limiter_that_catches_up():
    g = gate("clamp", joint={"max_step": 0.1})
    out, report = g.apply(chunk([[0.0, 0.0, 0.5], [0.3, 0.0, 0.5], [0.3, 0.0, 0.5], [0.3, 0.0, 0.5], [0.3, 0.0, 0.5]]), STATE)
    np.testing.assert_allclose(out[:, 0], [0.0, 0.1, 0.2, 0.3, 0.3], atol=1e-7)
    assert np.all(np.abs(np.diff(out[:, :2], axis=0)) <= 0.1 + 1e-6)
    assert report["clamped"]["step"]["values"] == 2
    assert report["clamped"]["step"]["max_excess"] == pytest.approx(0.2, abs=1e-6)


def test_clamp_velocity_uses_the_control_rate_and_the_binding_limit_is_named():
    g = gate("clamp", control_hz=10.0, joint={"max_step": 0.5, "max_velocity": 1.0})  # 1.0/s at 10 Hz: 0.1 per action
    out, report = g.apply(chunk([[0.0, 0.0, 0.5], [0.0, 0.4, 0.5]]), STATE)
    np.testing.assert_allclose(out[1, :2], [0.0, 0.1], atol=1e-7)
    assert set(report["clamped"]) == {"velocity"}


def test_clamp_reports_nothing_for_a_chunk_within_its_limits_and_leaves_it_equal():
    g = gate("clamp", joint={"max_first_step": 1.0, "max_step": 1.0, "max_velocity": 100.0}, gripper={"max_first_step": 1.0})
    actions = chunk([[0.1, 0.2, 0.4], [0.2, 0.1, 0.6]])
    out, report = g.apply(actions, STATE)
    np.testing.assert_array_equal(out, actions)
    assert out.dtype == np.float32
    assert report == {"mode": "clamp", "clamped": {}}


@pytest.mark.parametrize(
    ("limits", "rows", "check", "words"),
    [
        (
            {"gripper": {"max_first_step": 0.2}},
            [[0.0, 0.0, 0.9]],
            "first",
            ["gripper[0]", "0.4 from the observed state", "limit 0.2", "gripper.max_first_step"],
        ),
        (
            {"joint": {"max_step": 0.1}},
            [[0.0, 0.0, 0.5], [0.0, 0.0, 0.5], [0.0, -0.3, 0.5]],
            "step",
            ["joint[1]", "action 2 moves 0.3 from action 1", "limit 0.1", "joint.max_step"],
        ),
        (
            {"joint": {"max_velocity": 2.0}},
            [[0.0, 0.0, 0.5], [0.5, 0.0, 0.5]],
            "velocity",
            ["joint[0]", "at 5/s", "10 Hz", "limit 2/s", "joint.max_velocity"],
        ),
    ],
)
def test_reject_names_the_check_the_channel_the_value_and_the_limit_in_one_line(limits, rows, check, words):
    g = gate("reject", **limits)
    with pytest.raises(SafetyRejected) as info:
        g.apply(chunk(rows), STATE)
    message = str(info.value)
    assert isinstance(info.value, UnsupportedObservation)  # the engine's bad request: the session kept
    assert "\n" not in message and message.startswith(f"safety gate: {check}: ")
    for word in words:
        assert word in message, (word, message)
    assert rejected_check(message) == check
    assert rejected_check("prompt: too long") is None


def test_a_non_finite_action_is_rejected_and_clamp_holds_the_previous_value():
    rows = [[0.0, 0.0, 0.5], [np.nan, 0.0, 0.5]]
    with pytest.raises(SafetyRejected, match="joint\\[0\\]"):
        gate("reject", joint={"max_step": 1.0}).apply(chunk(rows), STATE)
    out, report = gate("clamp", joint={"max_step": 1.0}).apply(chunk(rows), STATE)
    assert out[1, 0] == 0.0 and report["clamped"]["step"]["values"] == 1


def test_frozen_rows_are_never_clamped_nor_blamed_and_the_step_after_them_is_checked():
    rows = [[0.9, 0.0, 0.5], [-0.9, 0.0, 0.5], [-0.9, 0.0, 0.5], [0.0, 0.0, 0.5]]  # rows 0-1 frozen: far from the state, a big step
    limits = {"joint": {"max_first_step": 0.1, "max_step": 0.2}}
    out, report = gate("clamp", **limits).apply(chunk(rows), STATE, frozen=2)
    np.testing.assert_array_equal(out[:2], chunk(rows)[:2])
    np.testing.assert_allclose(out[2:, 0], [-0.9, -0.7], atol=1e-6)  # from the last frozen row on, at the limit
    assert set(report["clamped"]) == {"step"} and report["clamped"]["step"]["first_at"] == "joint[0] action 3"
    gate("reject", **limits).apply(chunk(rows[:3]), STATE, frozen=2)  # only frozen rows break the limits: it passes
    with pytest.raises(SafetyRejected, match=r"action 3 moves 0\.9 from action 2"):
        gate("reject", **limits).apply(chunk(rows), STATE, frozen=2)


def test_a_key_the_embodiment_lacks_or_that_is_no_position_is_refused_at_start_up_by_name():
    with pytest.raises(StartRefused, match=r"policy.safety.limits.elbow: embodiment test_arm has no action key 'elbow'"):
        gate("clamp", elbow={"max_step": 0.1})
    with pytest.raises(StartRefused, match=r"policy.safety.limits.base_velocity: .*'base_velocity' is not a position"):
        gate("clamp", base_velocity={"max_step": 0.1})


def test_a_velocity_limit_without_a_control_rate_is_refused_unless_the_embodiment_has_one():
    with pytest.raises(StartRefused, match=r"policy\.safety\.control_hz: embodiment test_arm has no known control rate"):
        gate("clamp", control_hz=None, joint={"max_velocity": 1.0})
    gate("clamp", control_hz=None, joint={"max_step": 1.0})  # no velocity limit: no rate needed
    droid = SafetyGate.build(
        SafetyConfig(mode="reject", limits={"joint": {"max_velocity": 1.0}}), embodiment="oxe_droid", actions=ACTIONS, states=STATES
    )
    assert droid.control_hz == 15.0 and droid.describe()["control_hz"] == 15.0


def test_unknown_gate_keys_and_a_gate_without_limits_fail_at_config_load_naming_them():
    with pytest.raises(pydantic.ValidationError, match="max_stepp"):
        DreamZeroConfig(safety={"mode": "clamp", "limits": {"joint_position": {"max_stepp": 0.1}}})
    with pytest.raises(pydantic.ValidationError, match="modes"):
        DreamZeroConfig(safety={"modes": "clamp"})
    with pytest.raises(pydantic.ValidationError, match="mode clamp needs limits"):
        DreamZeroConfig(safety={"mode": "clamp"})
    with pytest.raises(pydantic.ValidationError, match="cannot apply to lingbot_va"):
        LingBotVAConfig(safety={"mode": "reject", "limits": {"x": {"max_step": 0.1}}})
    assert LingBotVAConfig(safety={"mode": "off"}).safety.mode == "off"


def test_clamp_with_the_bare_array_reply_that_cannot_say_so_fails_at_start_up():
    from ardiff_server.config import ConfigError, validate_config

    gate = {"mode": "clamp", "limits": {"joint_position": {"max_step": 0.1}}}
    with pytest.raises(ConfigError, match=r"policy\.safety\.mode: clamp must say so in the reply, which server\.reply_format array"):
        validate_config({"server": {"reply_format": "array"}, "policy": {"name": "dreamzero", "safety": gate}})
    validate_config({"server": {"reply_format": "array"}, "policy": {"name": "dreamzero", "safety": {**gate, "mode": "reject"}}})
    validate_config({"policy": {"name": "dreamzero", "safety": gate}})


def test_the_readme_gate_example_builds_for_droid():
    import re
    from pathlib import Path

    import yaml

    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    block = re.search(r"\*\*Safety gate\*\*.*?```yaml\n(.*?)```", readme, re.S).group(1)
    config = DreamZeroConfig(**yaml.safe_load(block)["policy"])
    droid = {"joint_position": (0, 7), "gripper_position": (7, 8)}
    built = SafetyGate.build(config.safety, embodiment="oxe_droid", actions=droid, states={**droid, "cartesian_position": (8, 14)})
    assert built.mode == "clamp" and built.control_hz == 15.0


def test_a_gate_key_typo_stops_the_server_config_naming_the_dotted_key():
    from ardiff_server.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"policy\.safety\.limits\.joint_position\.max_stepp: unknown key"):
        validate_config({"policy": {"name": "dreamzero", "safety": {"mode": "clamp", "limits": {"joint_position": {"max_stepp": 0.1}}}}})
    with pytest.raises(ConfigError, match=r"policy\.safety: .*cannot apply to lingbot_va"):
        validate_config({"policy": {"name": "lingbot_va", "safety": {"mode": "reject", "limits": {"a": {"max_step": 1.0}}}}})
