"""LingBot-VA's own messages (``wire/lingbot_va.py``): told apart from OpenPI's, decoded to typed requests, a bad
value refused naming its key."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_server.wire.decode import RequestError
from ardiff_server.wire.lingbot_va import action_reply, decode_lingbot_va, is_lingbot_va_message
from ardiff_server.wire.protocol import pack, unpack

CAMERAS = ("cam_high", "cam_left_wrist", "cam_right_wrist")


def frame(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    images = {f"observation.images.{c}": rng.integers(0, 256, (8, 12, 3), dtype=np.uint8) for c in CAMERAS}
    return {**images, "observation.state": np.zeros(14), "task": "x"}


def decode(message: dict):
    return decode_lingbot_va(unpack(pack(message)), CAMERAS)  # as it arrives: through openpi's codec


def test_messages_are_told_apart_from_openpi():
    assert is_lingbot_va_message({"reset": True, "prompt": "x"})
    assert is_lingbot_va_message({"obs": frame()}) and is_lingbot_va_message({"obs": [frame()], "compute_kv_cache": True})
    assert not is_lingbot_va_message({"observation/cam_high": np.zeros((2, 2, 3), np.uint8), "session_id": "a"})
    assert not is_lingbot_va_message({"endpoint": "reset", "obs": 1}) and not is_lingbot_va_message([1])


def test_reset_infer_and_compute_kv_cache_decode_to_typed_requests():
    reset = decode({"reset": True, "prompt": "grab the mug", "save_visualization": True})
    assert (reset.kind, reset.prompt, reset.observation) == ("reset", "grab the mug", None)
    infer = decode({"obs": frame(), "prompt": "ignored", "video_guidance_scale": 5.0, "action_guidance_scale": 1})
    assert infer.kind == "infer" and infer.observation.episode.kind == "infer"
    assert (infer.observation.episode.video_guidance_scale, infer.observation.episode.action_guidance_scale) == (5.0, 1.0)
    assert {k: v.shape for k, v in infer.observation.cameras.items()} == dict.fromkeys(CAMERAS, (1, 8, 12, 3))
    np.testing.assert_array_equal(infer.observation.cameras["cam_left_wrist"][0], frame()["observation.images.cam_left_wrist"])
    state = np.arange(16 * 2 * 16, dtype=np.float32).reshape(16, 2, 16)
    commit = decode({"obs": [frame(i) for i in range(4)], "compute_kv_cache": True, "imagine": False, "state": state})
    assert commit.kind == "compute_kv_cache" and commit.observation.cameras["cam_high"].shape == (4, 8, 12, 3)
    np.testing.assert_array_equal(commit.observation.cameras["cam_high"][3], frame(3)["observation.images.cam_high"])
    np.testing.assert_array_equal(commit.observation.episode.executed_actions, state)


@pytest.mark.parametrize(
    ("message", "key"),
    [
        ({"reset": True}, "prompt"),
        ({"reset": "yes", "prompt": "x"}, "reset"),
        ({"compute_kv_cache": True}, "obs"),
        ({"obs": [], "compute_kv_cache": True, "state": np.zeros((16, 2, 16))}, "obs"),
        ({"obs": [frame()], "compute_kv_cache": True, "state": [1, 2]}, "state"),
        ({"obs": [frame()], "compute_kv_cache": True}, "state"),
        ({"obs": frame(), "video_guidance_scale": "5"}, "video_guidance_scale"),
        ({"obs": frame(), "action_guidance_scale": float("nan")}, "action_guidance_scale"),
        ({"obs": {**frame(), "observation.images.cam_high": np.zeros((8, 12), np.uint8)}}, "obs.observation.images.cam_high"),
        ({"obs": {**frame(), "observation.images.cam_high": np.zeros((8, 12, 3), np.float32)}}, "cam_high"),
        (
            {
                "obs": [frame(), {**frame(), "observation.images.cam_right_wrist": np.zeros((4, 4, 3), np.uint8)}],
                "compute_kv_cache": True,
                "state": np.zeros((16, 2, 16)),
            },
            "cam_right_wrist",
        ),
        ({"obs": [frame(), 3], "compute_kv_cache": True, "state": np.zeros((16, 2, 16))}, "obs[1]"),
    ],
)
def test_a_bad_value_names_its_key(message, key):
    with pytest.raises(RequestError, match=key.replace("[", r"\[").replace("]", r"\]")):
        decode(message)


def test_actions_go_back_in_upstreams_layout():
    upstream = np.random.default_rng(0).normal(size=(16, 2, 16)).astype(np.float32)
    time_major = upstream.reshape(16, 32).T  # what the engine carries: (frames x actions per frame, channels)
    np.testing.assert_array_equal(action_reply(time_major, 16, 2, 16), upstream)


def test_openpi_requests_carry_guidance_only_to_a_policy_that_takes_it():
    from ardiff_policies.embodiment import ObservationSchema
    from ardiff_policies.episode import EpisodeCall
    from ardiff_server.wire.decode import decode_request

    schema = ObservationSchema("lingbot_va_tiny_robotwin", CAMERAS, (), ((8, 12),) * 3)
    images = {f"observation/{c}": np.zeros((8, 12, 3), np.uint8) for c in CAMERAS}

    def openpi(**extra):
        return unpack(pack({**images, "session_id": "a", "prompt": "x", **extra}))

    request = decode_request(openpi(video_guidance_scale=3, action_guidance_scale=np.float32(2.0)), schema, guidance=True)
    assert request.observation.episode == EpisodeCall("chunk", 3.0, 2.0)
    assert decode_request(openpi(action_guidance_scale=1.5), schema, guidance=True).observation.episode == EpisodeCall("chunk", None, 1.5)
    assert decode_request(openpi(video_guidance_scale=None), schema, guidance=True).observation.episode is None
    for value in ("5", True, float("inf")):
        with pytest.raises(RequestError, match="video_guidance_scale"):
            decode_request(openpi(video_guidance_scale=value), schema, guidance=True)
    with pytest.raises(RequestError, match="action_guidance_scale: this server's policy takes no per-request guidance"):
        decode_request(openpi(action_guidance_scale=2.0), schema)  # never silently ignored


def test_an_infer_carries_a_continuation_and_a_commit_refuses_one_by_name():
    """LingBot-VA's own ``infer`` takes the OpenPI wire's ``continuation`` (decoded alike, bad numbers named alike); a
    ``compute_kv_cache`` continues nothing, so one carrying it is refused naming it, not decoded without it."""
    from ardiff_policies.continuation import Continuation

    request = decode({"obs": frame(), "continuation": {"executed": 1, "delay": 2, "chunk_id": 3}})
    assert request.kind == "infer" and request.observation.continuation == Continuation(1, 2, 3)
    assert decode({"obs": frame(), "continuation": None}).observation.continuation is None
    timed = decode({"obs": frame(), "continuation": {"executed": 1, "delay": 2, "actions_left_s": 0.5}})  # its deadline, as OpenPI's
    assert timed.actions_left_s == 0.5 and request.actions_left_s is None
    with pytest.raises(RequestError, match=r"^continuation.actions_left_s: expected a finite number of seconds >= 0"):
        decode({"obs": frame(), "continuation": {"executed": 1, "delay": 2, "actions_left_s": -1}})
    with pytest.raises(RequestError, match=r"^continuation.delay: expected an integer >= 0"):
        decode({"obs": frame(), "continuation": {"executed": 1, "delay": -2}})
    with pytest.raises(RequestError, match=r"^continuation: unknown field"):
        decode({"obs": frame(), "continuation": {"executed": 1, "delay": 2, "late": 1}})
    commit = {"obs": [frame()] * 4, "compute_kv_cache": True, "state": np.zeros((16, 2, 16)), "continuation": {"executed": 1, "delay": 2}}
    with pytest.raises(RequestError, match=r"^continuation: a compute_kv_cache commits what the robot saw and continues nothing"):
        decode(commit)


def test_the_one_entry_point_decides_whose_message_a_frame_is():
    """``wire/decode.py`` decides the protocol: LingBot-VA's messages are its own only for a policy whose
    ``native_protocol`` is ``lingbot_va``; OpenPI's requests are OpenPI's for every policy, and a policy without
    LingBot-VA's protocol reads LingBot-VA's messages as OpenPI's and refuses them as such."""
    from ardiff_policies.embodiment import ObservationSchema
    from ardiff_policies.info import PolicyInfo
    from ardiff_server.wire.decode import decode_frame, decode_request
    from ardiff_server.wire.lingbot_va import LingBotVARequest
    from ardiff_server.wire.openpi import OpenPIRequest
    from ardiff_server.wire.protocol import DecodeLimits, ProtocolError

    schema = ObservationSchema("lingbot_va_tiny_robotwin", CAMERAS, (), ((8, 12),) * 3)
    info = PolicyInfo({"embodiment": schema.embodiment}, 32, 16, "m", observation_schema=schema, native_protocol="lingbot_va")
    images = {f"observation/{c}": np.zeros((8, 12, 3), np.uint8) for c in CAMERAS}

    def frame_of(message: dict, served: PolicyInfo = info):
        return decode_frame(pack(message), DecodeLimits(), served, max_request_pixels="auto", continuation_refused=None)

    lingbot = frame_of({"obs": frame()})
    assert isinstance(lingbot, LingBotVARequest) and (lingbot.protocol, lingbot.kind) == ("lingbot_va", "infer")
    assert frame_of({"reset": True, "prompt": "x"}).protocol == "lingbot_va"
    openpi = frame_of({**images, "session_id": "a", "prompt": "x"})
    assert isinstance(openpi, OpenPIRequest) and (openpi.protocol, openpi.endpoint, openpi.session_id) == ("openpi", "infer", "a")
    assert openpi.observation.cameras["cam_high"].shape == (1, 8, 12, 3)
    assert frame_of({"endpoint": "reset", "reset": True}).protocol == "openpi"  # an OpenPI endpoint: OpenPI's reset
    # a batch's elements are OpenPI's requests: a LingBot-VA message in one is refused as OpenPI's, in its slot
    batch = decode_frame(
        pack({"batch": [{**images, "session_id": "a"}, {"obs": frame()}]}),
        DecodeLimits(),
        info,
        max_request_pixels="auto",
        continuation_refused=None,
        max_batch_elements=2,
    )
    assert batch.protocol == "openpi_batch" and isinstance(batch.elements[0], OpenPIRequest)
    assert batch.elements[1].message.startswith("observation/cam_high: missing")
    assert decode_request({"obs": frame()}, schema, native_protocol="lingbot_va").protocol == "lingbot_va"
    other = PolicyInfo({"embodiment": schema.embodiment}, 32, 16, "m", observation_schema=schema)  # no native protocol
    with pytest.raises(RequestError, match=r"^observation/cam_high: missing"):
        frame_of({"obs": frame()}, other)
    with pytest.raises(ProtocolError, match="over the limit of 64 bytes"):  # the codec's bounds come first
        decode_frame(pack({"obs": frame()}), DecodeLimits(max_message_bytes=64), info, max_request_pixels="auto", continuation_refused=None)


def test_demonstration_keys_reach_only_a_policy_that_takes_a_demonstration():
    """Zero-WAM's reset keys (upstream's use_icl / icl_demo_id / guidance) on its RoboTwin wire and on an OpenPI
    session's first call; refused by name (never ignored) by a policy that takes none; server-side paths always."""
    from ardiff_policies.embodiment import ObservationSchema
    from ardiff_policies.episode import EpisodeCall, EpisodeStart
    from ardiff_server.wire.decode import decode_request

    reset = {"reset": True, "prompt": "x", "use_icl": True, "icl_demo_id": "task/episode0", "video_guidance_scale": -1, "icl_guidance_scale": 5}
    request = decode_lingbot_va(unpack(pack(reset)), CAMERAS, demonstrations=True)
    assert request.kind == "reset" and request.start == EpisodeStart(True, "task/episode0", -1.0, 5.0)
    plain = decode_lingbot_va(unpack(pack({"reset": True, "prompt": "x", "icl_demo_id": "a"})), CAMERAS, demonstrations=True)
    assert plain.start == EpisodeStart(True, "a")  # upstream's server: use_icl defaults to true
    for bad, match in (
        ({"icl_latent_path": "/srv/x.pth"}, "icl_latent_path: server-side paths are not taken"),
        ({"use_icl": 1}, "use_icl: expected true or false"),
        ({"icl_demo_id": 7}, "icl_demo_id: expected a demonstration's id"),
        ({"icl_demo_id": "a" * 513}, "icl_demo_id: expected at most 512 characters"),
        ({"icl_guidance_scale": "5"}, "icl_guidance_scale: expected a number"),
    ):
        with pytest.raises(RequestError, match=match):
            decode_lingbot_va(unpack(pack({**reset, **bad})), CAMERAS, demonstrations=True)
    with pytest.raises(RequestError, match="use_icl: this server's policy takes no demonstration"):
        decode(reset)  # LingBot-VA
    commit = decode_lingbot_va(unpack(pack({"obs": [frame()] * 4, "compute_kv_cache": True})), CAMERAS, demonstrations=True)
    assert commit.observation.episode == EpisodeCall("compute_kv_cache")  # Zero-WAM's state: optional, never read

    schema = ObservationSchema("zero_wam_tiny_robotwin", CAMERAS, (), ((8, 12),) * 3)
    images = {f"observation/{c}": np.zeros((8, 12, 3), np.uint8) for c in CAMERAS}

    def openpi(**extra):
        return unpack(pack({**images, "session_id": "a", "prompt": "x", **extra}))

    first = decode_request(openpi(icl_demo_id="task/episode0", icl_guidance_scale=4), schema, demonstrations=True)
    assert first.observation.episode == EpisodeCall("chunk", start=EpisodeStart(None, "task/episode0", None, 4.0))
    assert decode_request(openpi(), schema, demonstrations=True).observation.episode is None
    with pytest.raises(RequestError, match="action_guidance_scale: this server's policy takes no action guidance"):
        decode_request(openpi(action_guidance_scale=2.0), schema, demonstrations=True)
    for key in ("icl_demo_id", "use_icl", "icl_guidance_scale"):
        with pytest.raises(RequestError, match=f"{key}: this server's policy takes no demonstration"):
            decode_request(openpi(**{key: True if key == "use_icl" else "x" if key == "icl_demo_id" else 2.0}), schema, guidance=True)
