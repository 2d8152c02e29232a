"""Embodiments as data: built-in tags, a user's post-trained tag read from its checkpoint (or refused at start-up,
naming what is missing), the generic observation, its decoding and its trip through shared memory."""

from __future__ import annotations

import copy
import json
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.embodiments import HUMAN_TEMPLATE, YAM_TEMPLATE, embodiment_prompt, resolve
from ardiff_policies.dreamzero.tiny import agibot_metadata, ensure_tiny_checkpoint, run_config, yam_metadata
from ardiff_policies.dreamzero.transforms import stitch_canvas
from ardiff_policies.embodiment import EmbodimentError, ObservationSchema, Part, choose_tag
from ardiff_policies.info import PolicyInfo, droid_server_config
from ardiff_policies.observation import RobotObservation
from ardiff_server.engine.shm import InlineArray, SharedArena, SharedArray
from ardiff_server.wire.decode import RequestError, decode_request
from tests.helpers.server_harness import REPO

MY_TEMPLATE = "A two-view video shows that a robot arm {task} The left view is the wrist camera. The robot {task}"


def user_run(tag: str = "myarm", *, cameras=("wrist", "scene"), projector: int | None = 40) -> tuple[dict, dict]:
    """metadata.json and conf.yaml of a user's post-trained run with a new tag (YAM's statistics, renamed)."""
    yam = yam_metadata()["yam"]
    entry = copy.deepcopy(yam)
    entry["embodiment_tag"] = tag
    entry["modalities"]["video"] = {c: {"resolution": [320, 240], "channels": 3, "fps": 30.0} for c in cameras}
    config = run_config("yam", "annotation.task")
    config["modality_configs"] = {tag: copy.deepcopy(config["modality_configs"]["yam"])}
    config["modality_configs"][tag]["video"]["modality_keys"] = [f"video.{c}" for c in cameras]
    config["transforms"] = {tag: copy.deepcopy(config["transforms"]["yam"])}
    if projector is not None:
        config["embodiment_tag_to_projector_index"][tag] = projector
        config["transforms"][tag]["transforms"][-1]["embodiment_tag_mapping"][tag] = projector
    return {tag: entry}, config


# ----------------------------------------------------------------------------- resolution


def test_built_in_tags_need_only_metadata_json():
    agibot = resolve(agibot_metadata())
    assert agibot.tag == "agibot" and agibot.layout == "grid" and agibot.wire == "keys" and agibot.embodiment_id == 26
    assert agibot.state_dim == 20 and agibot.action_dim == 22 and "robot_velocity" not in agibot.relative_action_keys
    assert agibot.sources["keys"].startswith("built-in") and agibot.camera_resolutions == ((96, 160),) * 3
    yam = resolve(yam_metadata())
    assert yam.prompt_template == YAM_TEMPLATE and yam.action_split()[2] == {
        "name": "right_joint_pos",
        "start": 7,
        "stop": 13,
        "dim": 6,
        "relative_to_state": True,
    }
    assert embodiment_prompt(yam, None).startswith("A multi-view video shows that a robot perform the default behavior.")


def test_a_users_new_tag_is_served_from_its_run_config_and_template():
    metadata, config = user_run()
    with pytest.raises(EmbodimentError, match=r"'myarm' \(id 40\) has no prompt template in upstream's collate.*policy.prompt_template"):
        resolve(metadata, config)
    arm = resolve(metadata, config, prompt_template=MY_TEMPLATE)
    assert arm.cameras == ("wrist", "scene") and arm.layout == "grid" and arm.embodiment_id == 40
    assert arm.camera_resolutions == ((240, 320), (240, 320)) and arm.sources["keys"] == "experiment_cfg/conf.yaml modality_configs.myarm"
    assert embodiment_prompt(arm, "Wave") == "A two-view video shows that a robot arm wave The left view is the wrist camera. The robot wave"
    with pytest.raises(EmbodimentError, match=r"must contain \{task\}"):
        resolve(metadata, config, prompt_template="no placeholder")


def test_a_user_tag_sharing_an_upstream_id_gets_that_template_like_collate():
    metadata, config = user_run(projector=32)  # YAM's id: upstream's unmodified collate picks YAM's template
    assert resolve(metadata, config).prompt_template == YAM_TEMPLATE
    metadata, config = user_run(cameras=("ego",), projector=24)  # GR1's id, one camera: the single-view layout
    single = resolve(metadata, config)
    assert single.prompt_template == HUMAN_TEMPLATE and single.layout == "single"
    view = np.full((2, 4, 6, 3), 7, np.uint8)
    assert np.array_equal(stitch_canvas(single.layout, [view], (4, 6)), view)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda m, c: c.clear(), r"'myarm': no camera, state and action key order: the checkpoint has no experiment_cfg/conf.yaml"),
        (
            lambda m, c: m["myarm"]["statistics"]["action"].pop("left_gripper_pos"),
            r"metadata.json myarm.statistics.action.left_gripper_pos: expected q01 and q99",
        ),
        (lambda m, c: m["myarm"]["statistics"].pop("state"), r"metadata.json myarm.statistics.state is missing"),
        (
            lambda m, c: c["transforms"]["myarm"]["transforms"][6]["normalization_modes"].update({"state.left_joint_pos": "min_max"}),
            r"transforms.myarm: state.left_joint_pos has normalization mode 'min_max'; this server implements q99 only",
        ),
        (lambda m, c: c.update(relative_action_per_horizon=True), r"relative_action_per_horizon is true"),
        (
            lambda m, c: c["modality_configs"]["myarm"]["state"].update(modality_keys=["state.left_joint_pos"]),
            r"relative action key 'left_gripper_pos' \(1 dims\) needs a state key of the same name",
        ),
        (
            lambda m, c: c["modality_configs"]["myarm"]["video"].update(modality_keys=[f"video.c{i}" for i in range(4)]),
            r"has 4 cameras .* first three only",
        ),
        (lambda m, c: m["myarm"]["modalities"]["state"]["left_joint_pos"].update(shape=[7]), r"6 statistics for a key of shape \(7,\)"),
    ],
)
def test_what_a_checkpoint_lacks_is_refused_naming_it(damage, needle):
    metadata, config = user_run()
    damage(metadata, config)
    with pytest.raises(EmbodimentError, match=needle):
        resolve(metadata, config, prompt_template=MY_TEMPLATE)


def test_the_served_tag_is_chosen_from_metadata_json():
    both = {**agibot_metadata(), **yam_metadata()}
    with pytest.raises(EmbodimentError, match=r"holds 2 embodiments \['agibot', 'yam'\]; choose one: --set policy.embodiment"):
        choose_tag(both, None)
    assert choose_tag({**both, "oxe_droid": {}}, None) == "oxe_droid"  # what was served before tags were configurable
    assert resolve(both, tag="yam").tag == "yam"
    with pytest.raises(EmbodimentError, match=r"policy.embodiment: experiment_cfg/metadata.json has no 'gr1'"):
        resolve(both, tag="gr1")


@pytest.fixture
def user_checkpoint(tmp_path):
    """A user's post-trained run on disk: the tiny YAM checkpoint with its embodiment renamed to a new tag."""
    out = tmp_path / "myarm-run"
    shutil.copytree(ensure_tiny_checkpoint(variant="tiny_yam"), out)
    metadata, config = user_run(cameras=("wrist", "scene", "top"))
    (out / "experiment_cfg" / "metadata.json").write_text(json.dumps(metadata))
    (out / "experiment_cfg" / "conf.yaml").write_text(yaml.safe_dump(config))
    return out


def test_a_user_run_without_a_template_fails_at_start_up_in_one_line(user_checkpoint):
    with pytest.raises(ValueError, match=r"policy\.prompt_template"):
        DreamZeroConfig(checkpoint=str(user_checkpoint), view_size=(48, 80)).preflight()
    out = subprocess.run(
        [sys.executable, "-m", "ardiff_server", "--config", "tiny_yam", "--set", f"policy.checkpoint={user_checkpoint}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "'myarm' (id 40) has no prompt template" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_user_run_with_its_template_is_served(user_checkpoint):
    from ardiff_kv import PagedKVCache
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy

    config = DreamZeroConfig(checkpoint=str(user_checkpoint), view_size=(48, 80), prompt_template=MY_TEMPLATE)
    config.preflight()
    policy = DreamZeroPolicy(config, RuntimeOptions())
    info = policy.info
    assert info.server_config["embodiment"] == "myarm" and info.observation_schema.cameras == ("wrist", "scene", "top")
    spec = policy.kv_spec()
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, branches=policy.branches)
    session = policy.start_session("s", cache.open_session("s"))
    request = {f"observation/{c}": np.zeros((240, 320, 3), np.uint8) for c in ("wrist", "scene", "top")}
    request |= {f"observation/{p.name}": np.zeros(p.dim) for p in info.observation_schema.states} | {"prompt": "wave"}
    result = policy.step(session, decode_request(request, info.observation_schema).observation)
    assert result.actions.shape == (24, 14) and np.isfinite(result.actions).all()
    assert session.prompt.startswith("A two-view video shows that a robot arm wave")
    cache.end_session(session.kv)


# ----------------------------------------------------------------------------- the wire


SCHEMA = ObservationSchema("arm", ("top", "wrist"), (Part("joints", 6), Part("grip", 1)), ((96, 160), (96, 160)))


def arm_request(**overrides) -> dict:
    request = {
        "observation/top": np.zeros((96, 160, 3), np.uint8),
        "observation/wrist": np.zeros((4, 50, 60, 3), np.uint8),
        "observation/joints": np.arange(6.0),
        "observation/grip": np.array([[0.5]]),
        "prompt": "go",
        "session_id": 7,
    }
    return {k: v for k, v in {**request, **overrides}.items() if v is not None}


def test_an_embodiments_keys_decode_by_its_schema():
    decoded = decode_request(arm_request(), SCHEMA)
    observation = decoded.observation
    assert decoded.session_id == "7" and observation.prompt == "go"
    assert set(observation.cameras) == {"top", "wrist"} and observation.cameras["top"].shape == (1, 96, 160, 3)
    assert observation.states["joints"].dtype == np.float32 and observation.states["grip"].tolist() == [0.5]
    for value in ([0, 1, 2, 3, 4, 5], [[0, 1, 2, 3, 4, 5]], np.arange(6.0)[None]):  # lists and a batch of one
        assert decode_request(arm_request(**{"observation/joints": value}), SCHEMA).observation.states["joints"].tolist() == list(range(6))
    assert decode_request(arm_request(prompt=None), SCHEMA).observation.prompt is None  # -> the default instruction
    assert decode_request({"endpoint": "reset", "session_id": "x"}, SCHEMA).endpoint == "reset"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"observation/grip": None}, "observation/grip: missing; expected 1 number (float, float array or list)"),
        (
            {"observation/top": None, "observation/tpo": np.zeros((2, 2, 3), np.uint8)},
            "observation/top: missing; expected a uint8 RGB image array (H, W, 3) or frame stack (T, H, W, 3), or JPEG bytes "
            "(a list of them for a stack) (this server serves embodiment arm; unknown keys ['observation/tpo'])",
        ),
        ({"observation/joints": np.zeros((2, 6))}, "observation/joints: expected 6 numbers (float array or list), got shape (2, 6)"),
        ({"observation/joints": [[0] * 6, [0] * 6]}, "observation/joints: expected 6 numbers (float array or list), got a list of 2"),
        ({"observation/wrist": np.zeros((50, 60), np.uint8)}, "observation/wrist: expected a uint8 RGB image array"),
        ({"prompt": 3}, "prompt: expected a string, got int"),
    ],
)
def test_wrong_or_missing_keys_are_one_line_errors_naming_the_key(overrides, message):
    with pytest.raises(RequestError) as caught:
        decode_request(arm_request(**overrides), SCHEMA)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_policy_info_carries_roboarenas_frame_or_the_embodiments():
    PolicyInfo(droid_server_config(), 24, 8, "m")
    with pytest.raises(ValueError, match="exactly RoboArena's"):
        PolicyInfo({"embodiment": "arm"}, 24, 7, "m")
    with pytest.raises(ValueError, match="must name the embodiment"):
        PolicyInfo({"embodiment": "other"}, 24, 7, "m", observation_schema=SCHEMA)
    info = PolicyInfo({"embodiment": "arm"}, 24, 7, "m", observation_schema=SCHEMA)
    assert pickle.loads(pickle.dumps(info)) == info  # it travels in the worker's Ready message


# ----------------------------------------------------------------------------- the observation


def test_the_observation_keeps_the_droid_names_and_takes_any_embodiments():
    droid = RobotObservation(wrist=np.zeros((1, 2, 2, 3), np.uint8), joint_position=np.zeros(7, np.float32), prompt="p")
    assert set(droid.cameras) == {"wrist", "exterior_left", "exterior_right"} and droid.exterior_left is None
    assert set(droid.states) == {"joint_position", "gripper_position", "cartesian_position"}
    copied = RobotObservation(**{**droid.__dict__, "prompt": "q"})
    assert copied.prompt == "q" and copied.wrist is droid.wrist
    arm = RobotObservation(cameras={"top": np.ones((1, 2, 2, 3), np.uint8)}, states={"joints": np.ones(6, np.float32)}, prompt=None)
    assert set(arm.arrays()) == {"top", "joints"} and arm.wrist is None and arm.prompt is None
    restored = pickle.loads(pickle.dumps(arm))
    assert np.array_equal(restored.cameras["top"], arm.cameras["top"]) and restored.prompt is None
    with pytest.raises(KeyError, match="no camera or state named"):
        arm.with_arrays({"nope": np.zeros(1)})
    with pytest.raises(TypeError, match="unknown keyword"):
        RobotObservation(top=np.zeros(1))
    with pytest.raises(AttributeError):
        arm.prompt = "x"


def test_an_embodiments_observation_through_shared_memory_reads_back_exactly():
    arena = SharedArena.create(2**20)
    try:
        original = decode_request(arm_request(), SCHEMA).observation
        placed, allocations = arena.put(original)
        assert isinstance(placed.cameras["top"], SharedArray) and isinstance(placed.states["joints"], InlineArray)
        seen = arena.view(pickle.loads(pickle.dumps(placed)))
        for name, array in original.arrays().items():
            got = {**seen.cameras, **seen.states}[name]
            np.testing.assert_array_equal(got, array)
            assert not got.flags.writeable
        for allocation in allocations:
            arena.free(allocation)
        assert arena.in_use == 0
    finally:
        arena.close()


def test_every_embodiment_uses_category_slot_0_as_upstream_and_its_checkpoints_hold_one_slot():
    """Upstream's CausalWanModel sets max_num_embodiments = 1 and indexes category 0 whatever the embodiment
    id; the released checkpoint's category-specific layers have a leading dimension of 1, and so do ours."""
    from safetensors import safe_open

    from tests.helpers.reference import REFERENCE_DIR

    def category_layers(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
        parts = (".state_encoder.", ".action_encoder.W", ".action_decoder.")
        return {n: s for n, s in shapes.items() if any(p in n for p in parts)}

    checkpoint = ensure_tiny_checkpoint(variant="tiny_agibot")
    with safe_open(str(checkpoint / "model-00001-of-00002.safetensors"), framework="pt") as shard:
        tiny = category_layers({n: list(shard.get_slice(n).get_shape()) for n in shard.keys()})  # noqa: SIM118
    assert len(tiny) == 14 and all(shape[0] == 1 for shape in tiny.values())
    released = REFERENCE_DIR / "dreamzero_droid_tensors.json"
    if not released.exists():
        pytest.skip(f"{released} is absent (the released checkpoint's tensor shapes)")
    shapes = category_layers({n: s for n, (s, _) in json.loads(released.read_text())["tensors"].items()})
    assert len(shapes) == 14 and all(shape[0] == 1 for shape in shapes.values())


def test_tiny_run_configs_carry_upstreams_video_eval_delta_indices(tmp_path):
    """AgiBot's run config asks for the last 4 frames ([-3, -2, -1, 0], base_48_wan_fine_aug_relative.yaml), YAM's for
    one; the tiny checkpoints' cache key follows the run config, so a cache written before the fix is not reused."""
    import yaml

    from ardiff_policies.dreamzero import tiny

    for variant, expected in (("tiny_agibot", [-3, -2, -1, 0]), ("tiny_yam", [0])):
        conf = yaml.safe_load((ensure_tiny_checkpoint(variant=variant) / "experiment_cfg" / "conf.yaml").read_text())
        (tag,) = conf["modality_configs"]
        assert conf["modality_configs"][tag]["video"]["eval_delta_indices"] == expected
    before = tiny._definition_digest("tiny_agibot")  # noqa: SLF001
    original = dict(tiny.VIDEO_EVAL_DELTA_INDICES)
    try:
        tiny.VIDEO_EVAL_DELTA_INDICES["agibot"] = [0]
        assert tiny._definition_digest("tiny_agibot") != before  # noqa: SLF001
    finally:
        tiny.VIDEO_EVAL_DELTA_INDICES.update(original)
