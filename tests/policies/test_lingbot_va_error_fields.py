"""LingBot-VA's refusals name the fields the client sent (issue #38, item 4): an OpenPI client sent
``observation/<camera>`` keys and is never told about ``obs``, LingBot-VA's own protocol's field, and the other way round."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_policies.episode import EpisodeCall
from ardiff_policies.observation import RobotObservation, UnsupportedObservation
from ardiff_server.config import load_config
from ardiff_server.engine.builder import build_engine


@pytest.fixture(scope="module")
def policy():
    engine = build_engine(load_config("tiny_lingbot_va", overrides=["engine.warmup=false"]))
    yield engine.policy
    engine.close()


def uneven(policy, call: EpisodeCall | None) -> RobotObservation:
    """Every camera one frame but the first, which has four."""
    frames = {
        name: np.zeros((4 if i == 0 else 1, h, w, 3), np.uint8) for i, (name, (h, w)) in enumerate(zip(policy.cameras, policy.schema.resolutions))
    }
    return RobotObservation(frames, {}, "stack the cube", call)


def test_an_openpi_request_with_uneven_frame_counts_is_told_its_own_camera_keys(policy):
    with pytest.raises(UnsupportedObservation) as caught:
        policy.check_observation(uneven(policy, None))
    message = str(caught.value)
    assert message.startswith("observation: every camera needs the same number of frames")
    assert f"observation/{policy.cameras[0]}: 4" in message and f"observation/{policy.cameras[1]}: 1" in message
    assert "obs:" not in message


def test_a_missing_camera_is_named_by_the_key_of_the_protocol_that_sent_it(policy):
    missing = policy.cameras[-1]
    for call, field in ((None, f"observation/{missing}"), (EpisodeCall("infer"), f"obs: observation.images.{missing}")):
        frames = {name: np.zeros((1, h, w, 3), np.uint8) for name, (h, w) in zip(policy.cameras[:-1], policy.schema.resolutions)}
        with pytest.raises(UnsupportedObservation, match=f"^{field}: camera missing"):
            policy.check_observation(RobotObservation(frames, {}, "stack the cube", call))


def test_lingbot_vas_own_protocol_still_names_obs(policy):
    with pytest.raises(UnsupportedObservation, match=r"^obs: every camera needs the same number of frames, got \[1, 4\]"):
        policy.check_observation(uneven(policy, EpisodeCall("infer")))
