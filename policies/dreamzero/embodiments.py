"""DreamZero's embodiments: upstream's built-in definitions, and how one is read from a checkpoint (torch-free).

Everything here is upstream's definition (dreamzero0/dreamzero), as data:

* key orders and relative action keys: ``groot/vla/configs/data/dreamzero/base_48_wan_fine_aug_relative.yaml``
  (``modality_config_<tag>``) and ``<tag>_relative.yaml`` (``relative_action_keys``), for the three embodiments it
  defines (oxe_droid, agibot, yam);
* embodiment ids: ``groot/vla/configs/model/dreamzero/transform/base.yaml`` (``embodiment_tag_to_projector_index``);
* prompt templates: ``groot/vla/model/dreamzero/transform/dreamzero_cotrain.py`` ``collate``, which picks a template by
  comparing the sample's embodiment id with the ids of AgiBot (only with more than one view), DROID, GR1, MECKA hands,
  XDOF and YAM, in that order, and fails for any other id;
* the canvas: ``DreamTransform._prepare_video``: DROID (with 3 views) puts the wrist view across the top and the two
  exterior views below; any other embodiment with 2 or 3 views gets a 2x2 grid (view 0 top-left, view 1 bottom-left,
  view 2 top-right, bottom-right black); a single view is the canvas itself.

A training run's ``experiment_cfg/conf.yaml`` (upstream's resolved hydra config) is authoritative where it exists:
its ``modality_configs.<tag>``, ``relative_action_keys``, the tag's transform pipeline (crop scale, resize, q99
normalization modes, the DreamTransform's embodiment ids and default instruction). A tag without a built-in key order
is served from the run's config; what a checkpoint lacks is refused at start-up, naming it.

Note on the DiT's category-specific layers: upstream builds them with one category (``CausalWanModel.__init__`` sets
``max_num_embodiments = 1``) and indexes category 0 in every forward, whatever the sample's embodiment id; the released
checkpoints hold a leading category dimension of 1. The embodiment id therefore selects the prompt template, not the
encoder slot, exactly as upstream.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ardiff_policies.embodiment import Embodiment, EmbodimentError, Part, camera_resolutions, choose_tag, read_statistics
from ardiff_policies.observation import STATES
from ardiff_policies.wan.prompt import clean_prompt

# ------------------------------------------------------------------------------ prompts

# The instruction's path through upstream (see policies/dreamzero/transforms.py for the DROID server's steps):
# DreamTransform._prepare_language removes these markers; collate ``ast.literal_eval``s the text and lower-cases it
# into the template; HuggingfaceTokenizer(clean="whitespace") cleans the whole templated string.
_UPSTREAM_MARKERS = ("<LAPA>", "<DREAM>", "<COTRAIN>")
DEFAULT_INSTRUCTION = "Perform the default behavior."  # DreamTransform.default_instruction (dreamzero_cotrain.yaml)

_MULTI_VIEW = "A multi-view video shows that a robot {task} The video is split into "
DROID_TEMPLATE = (
    _MULTI_VIEW + "three views: The top view shows the camera view from the robot's wrist, the bottom-left view shows "
    "the camera view from the left exterior camera, and the bottom-right view shows the camera view from the right "
    "exterior camera. During training, one of the two bottom exterior views may be a black screen (dropped view). "
    "The robot {task}"
)
HEAD_HANDS_TEMPLATE = (  # AgiBot and XDOF
    _MULTI_VIEW + "four views: The top-left view shows the camera view from the robot's head, the top-right view shows "
    "the camera view from the right hand, the bottom-left view shows the camera view from the left hand, and the "
    "bottom-right view is a black screen (inactive view). The robot {task}"
)
YAM_TEMPLATE = (
    _MULTI_VIEW + "four views: The top-left view shows the top camera, the top-right view shows the right camera, the "
    "bottom-left view shows the left camera, and the bottom-right view is a black screen. The robot {task}"
)
HUMAN_TEMPLATE = "A single view video shows that a human {task}"  # GR1 and MECKA hands

# collate's branches in order: (the tag whose id selects the template, template, only with more than one view)
UPSTREAM_TEMPLATES: tuple[tuple[str, str, bool], ...] = (
    ("agibot", HEAD_HANDS_TEMPLATE, True),
    ("oxe_droid", DROID_TEMPLATE, False),
    ("gr1_unified", HUMAN_TEMPLATE, False),
    ("mecka_hands", HUMAN_TEMPLATE, False),
    ("xdof", HEAD_HANDS_TEMPLATE, False),
    ("yam", YAM_TEMPLATE, False),
)

# upstream's embodiment_tag_to_projector_index (several tags share an id; collate compares ids, so e.g. "lapa"
# gets MECKA hands' template).
PROJECTOR_INDEX: dict[str, int] = {
    "real_gr1_arms_only": 0,
    "real_gr1_arms_only_annotated": 1,
    "real_gr1_arms_waist": 2,
    "real_gr1_arms_waist_annotated": 3,
    "dexmg_gr1_arms_only_inspire": 4,
    "dexmg_gr1_arms_only_fourier": 5,
    "dexmg_gr1_arms_waist_fourier": 6,
    "robocasa_single_arm": 7,
    "onex_eve_gripper": 8,
    "robocasa_gr1_arms_only_inspire_hands": 9,
    "robocasa_gr1_arms_only_fourier_hands": 10,
    "robocasa_gr1_fixed_lower_body_inspire_hands": 11,
    "robocasa_gr1_fixed_lower_body_fourier_hands": 12,
    "robocasa_panda_omron": 13,
    "robocasa_bimanual_panda_parallel_gripper": 15,
    "robocasa_bimanual_panda_inspire_hand": 16,
    "oxe_droid": 17,
    "oxe_fractal": 18,
    "oxe_language_table": 19,
    "oxe_bridge": 20,
    "real_panda_single_arm": 21,
    "hot3d_hands_only": 23,
    "gr1_unified": 24,
    "robocasa_gr1_arms_waist_fourier_hands": 25,
    "agibot": 26,
    "lapa": 27,
    "oxe_mutex": 28,
    "oxe_roboset": 29,
    "oxe_plex": 30,
    "dream": 31,
    "yam": 32,
    "xdof": 22,
    "gr1_unified_segmentation": 14,
    "language_table_sim": 7,
    "gr1_isaac": 0,
    "sim_behavior_r1_pro": 31,
    "mecka_hands": 27,
    "real_r1_pro_sharpa": 28,
}


def instruction(prompt: str | None) -> str:
    """The instruction as upstream's ``collate`` inserts it into a template (before lower-casing).

    None is the empty instruction. Raises ValueError for an empty list/tuple literal (``"[]"``), on which
    upstream's ``collate`` fails.
    """
    text = "" if prompt is None else prompt.rstrip("\0")
    for marker in _UPSTREAM_MARKERS:
        text = text.replace(marker, "")
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        return text
    if isinstance(parsed, (list, tuple)):
        if not parsed:
            raise ValueError(f"prompt {prompt!r} is an empty {type(parsed).__name__} literal (upstream DreamZero fails on it)")
        return str(parsed[0])
    return str(parsed)


def render_prompt(template: str, prompt: str | None) -> str:
    """The exact text upstream tokenizes: instruction, lower-cased into the template, cleaned."""
    task = instruction(prompt).lower()
    return clean_prompt(template.replace("{task}", task))


def embodiment_prompt(embodiment: Embodiment, prompt: str | None) -> str:
    """The text tokenized for a client's prompt (None: the embodiment's default instruction)."""
    return render_prompt(embodiment.prompt_template, embodiment.default_instruction if prompt is None else prompt)


def upstream_template(embodiment_id: int | None, ids: Mapping[str, int], num_views: int) -> str | None:
    """The template upstream's ``collate`` uses for a sample of this embodiment id (None: it raises)."""
    if embodiment_id is None:
        return None
    for tag, template, multi_view_only in UPSTREAM_TEMPLATES:
        if tag in ids and embodiment_id == ids[tag] and (num_views > 1 or not multi_view_only):
            return template
    return None


# ------------------------------------------------------------------------------ built-in key orders


@dataclass(frozen=True)
class Modalities:
    """A modality config: key names without the ``video.`` / ``state.`` / ``action.`` prefix, in order."""

    cameras: tuple[str, ...]
    states: tuple[str, ...]
    actions: tuple[str, ...]
    relative_action_keys: tuple[str, ...]


BUILTIN_MODALITIES: dict[str, Modalities] = {
    "oxe_droid": Modalities(
        ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"),
        ("joint_position", "gripper_position"),
        ("joint_position", "gripper_position"),
        ("joint_position",),
    ),
    "agibot": Modalities(
        ("top_head", "hand_left", "hand_right"),
        (
            "left_arm_joint_position",
            "right_arm_joint_position",
            "left_effector_position",
            "right_effector_position",
            "head_position",
            "waist_position",
        ),
        (
            "left_arm_joint_position",
            "right_arm_joint_position",
            "left_effector_position",
            "right_effector_position",
            "head_position",
            "waist_position",
            "robot_velocity",
        ),
        (
            "left_arm_joint_position",
            "right_arm_joint_position",
            "left_effector_position",
            "right_effector_position",
            "head_position",
            "waist_position",
        ),
    ),
    "yam": Modalities(
        ("top_camera-images-rgb", "left_camera-images-rgb", "right_camera-images-rgb"),
        ("left_joint_pos", "left_gripper_pos", "right_joint_pos", "right_gripper_pos"),
        ("left_joint_pos", "left_gripper_pos", "right_joint_pos", "right_gripper_pos"),
        ("left_joint_pos", "left_gripper_pos", "right_joint_pos", "right_gripper_pos"),
    ),
}
# DROID is served on RoboArena's keys: its dataset cameras under the names the decoder gives them.
DROID_CAMERAS = {"exterior_image_1_left": "exterior_left", "exterior_image_2_left": "exterior_right", "wrist_image_left": "wrist"}
BUILTIN_TAGS = tuple(sorted({*BUILTIN_MODALITIES, *(tag for tag, _, _ in UPSTREAM_TEMPLATES)}))


# ------------------------------------------------------------------------------ a run's experiment config


@dataclass(frozen=True)
class RunConfig:
    """What a training run's ``experiment_cfg/conf.yaml`` says about one embodiment (None: it does not say)."""

    modalities: Modalities | None = None
    relative_action_keys: tuple[str, ...] | None = None
    ids: Mapping[str, int] | None = None
    num_views: int = 3  # DreamTransform.num_views (its default)
    default_instruction: str | None = None
    crop_scale: float | None = None
    view_size: tuple[int, int] | None = None  # VideoResize (height, width)
    normalization_modes: Mapping[str, str] | None = None  # "state.x" / "action.x" -> mode
    rotations: tuple[str, ...] = ()

    @classmethod
    def read(cls, config: Mapping[str, Any] | None, tag: str) -> RunConfig:
        if not isinstance(config, Mapping):
            return cls()
        where = "experiment_cfg/conf.yaml"
        modalities = None
        section = (config.get("modality_configs") or {}).get(tag)
        if isinstance(section, Mapping):

            def keys(kind: str) -> tuple[str, ...]:
                listed = (section.get(kind) or {}).get("modality_keys") or []
                return tuple(str(k).split(".", 1)[1] if str(k).startswith(f"{kind}.") else str(k) for k in listed)

            relative = ()
            if config.get("relative_action"):
                relative = tuple(str(k) for k in config.get("relative_action_keys") or ())
            if config.get("relative_action_per_horizon"):
                raise EmbodimentError(f"{where}: relative_action_per_horizon is true; per-horizon statistics are not supported")
            modalities = Modalities(keys("video"), keys("state"), keys("action"), relative)
        run = {"modalities": modalities, "relative_action_keys": modalities.relative_action_keys if modalities else None}
        if isinstance(ids := config.get("embodiment_tag_to_projector_index"), Mapping):
            run["ids"] = {str(k): int(v) for k, v in ids.items()}
        pipeline = ((config.get("transforms") or {}).get(tag) or {}).get("transforms") or []
        modes: dict[str, str] = {}
        rotations: list[str] = []
        for step in pipeline if isinstance(pipeline, list) else []:
            target = str(step.get("_target_", "")).rsplit(".", 1)[-1] if isinstance(step, Mapping) else ""
            if target == "VideoCrop":
                run["crop_scale"] = float(step["scale"])
            elif target == "VideoResize":
                run["view_size"] = (int(step["height"]), int(step["width"]))
            elif target == "StateActionTransform":
                modes.update({str(k): str(v) for k, v in (step.get("normalization_modes") or {}).items()})
                rotations += [str(k) for k in step.get("target_rotations") or {}]
            elif target == "DreamTransform":
                if isinstance(mapping := step.get("embodiment_tag_mapping"), Mapping):
                    run["ids"] = {str(k): int(v) for k, v in mapping.items()}
                run["num_views"] = int(step.get("num_views", 3))
                if step.get("default_instruction") is not None:
                    run["default_instruction"] = str(step["default_instruction"])
        if pipeline:
            run["normalization_modes"] = modes
        return cls(**run, rotations=tuple(rotations))


def read_experiment_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """A checkpoint's ``experiment_cfg/conf.yaml`` (None when absent)."""
    import yaml

    path = Path(checkpoint).expanduser() / "experiment_cfg" / "conf.yaml"
    if not path.is_file():
        return None
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise EmbodimentError(f"cannot read {path}: {exc}") from None
    return loaded if isinstance(loaded, dict) else None


# ------------------------------------------------------------------------------ resolution


def resolve(
    metadata: Mapping[str, Any],
    experiment_config: Mapping[str, Any] | None = None,
    *,
    tag: str | None = None,
    prompt_template: str | None = None,
) -> Embodiment:
    """The embodiment a checkpoint serves: ``tag`` (None: metadata.json's only one) with its statistics from
    ``metadata.json``, key orders from the run's ``conf.yaml`` or upstream's built-in definition, and its prompt
    template from upstream's ``collate`` (or ``prompt_template``, for a tag upstream has none for).
    Raises :class:`EmbodimentError` naming what is missing."""
    tag = choose_tag(metadata, tag)
    run = RunConfig.read(experiment_config, tag)
    sources: dict[str, str] = {"statistics": f"experiment_cfg/metadata.json {tag}"}
    if run.modalities is not None:
        modalities, sources["keys"] = run.modalities, f"experiment_cfg/conf.yaml modality_configs.{tag}"
    elif tag in BUILTIN_MODALITIES:
        modalities, sources["keys"] = BUILTIN_MODALITIES[tag], "built-in (upstream's base_48_wan_fine_aug_relative.yaml)"
    else:
        raise EmbodimentError(
            f"embodiment {tag!r}: no camera, state and action key order: the checkpoint has no experiment_cfg/conf.yaml "
            f"with modality_configs.{tag} (copy the training run's experiment_cfg/ into the checkpoint directory)"
        )
    if not modalities.cameras or not modalities.actions:
        raise EmbodimentError(f"embodiment {tag!r}: {sources['keys']} lists no video or no action keys")
    _check_normalization(tag, modalities, run)

    ids = run.ids if run.ids is not None else PROJECTOR_INDEX
    embodiment_id = ids.get(tag)
    template = prompt_template
    sources["prompt_template"] = "policy.prompt_template"
    if template is None:
        template = upstream_template(embodiment_id, ids, run.num_views)
        sources["prompt_template"] = "upstream's collate"
    if template is None:
        known = ", ".join(tag for tag, _, _ in UPSTREAM_TEMPLATES)
        raise EmbodimentError(
            f"embodiment {tag!r} (id {embodiment_id}) has no prompt template in upstream's collate (it has {known}); "
            f"set the one the run was trained with: --set policy.prompt_template='A multi-view video shows that a robot {{task}} ...'"
        )
    if "{task}" not in template:
        raise EmbodimentError(f"policy.prompt_template must contain {{task}} where the instruction goes, got {template!r}")

    states, state_stats = read_statistics(metadata, tag, "state", modalities.states)
    actions, action_stats = read_statistics(metadata, tag, "action", modalities.actions)
    _check_relative(tag, modalities.relative_action_keys, states, actions)
    relative = tuple(key for key in modalities.relative_action_keys if key in {p.name for p in actions})

    cameras = modalities.cameras
    if tag == "oxe_droid":
        layout, wire = "droid", "roboarena"
        if cameras != BUILTIN_MODALITIES["oxe_droid"].cameras or any(p.name not in STATES for p in states):
            raise EmbodimentError(
                f"oxe_droid is served on RoboArena's DROID keys: its cameras must be {list(DROID_CAMERAS)} and its state "
                f"keys among {list(STATES)}; {sources['keys']} has {list(cameras)} and {[p.name for p in states]}"
            )
        resolutions = camera_resolutions(metadata, tag, cameras)
        cameras = tuple(DROID_CAMERAS[c] for c in cameras)
    else:
        if len(cameras) > 3:
            raise EmbodimentError(
                f"embodiment {tag!r} has {len(cameras)} cameras {list(cameras)}; upstream's 2x2 canvas shows the first "
                "three only (DreamTransform._prepare_video), so the model never saw the others"
            )
        layout, wire = ("grid" if len(cameras) > 1 else "single"), "keys"
        resolutions = camera_resolutions(metadata, tag, cameras)
    default_instruction = run.default_instruction if run.default_instruction is not None else DEFAULT_INSTRUCTION
    return Embodiment(
        tag=tag,
        cameras=cameras,
        states=states,
        actions=actions,
        relative_action_keys=relative,
        state_stats=state_stats,
        action_stats=action_stats,
        embodiment_id=embodiment_id,
        prompt_template=template,
        # upstream's DROID server sends "" for a missing prompt (see transforms.py); the eval transform's default otherwise
        default_instruction="" if wire == "roboarena" else default_instruction,
        layout=layout,
        wire=wire,
        camera_resolutions=resolutions,
        crop_scale=run.crop_scale if run.crop_scale is not None else 0.95,
        trained_view_size=run.view_size,
        sources=sources,
    )


def _check_normalization(tag: str, modalities: Modalities, run: RunConfig) -> None:
    where = f"experiment_cfg/conf.yaml transforms.{tag}"
    if run.rotations:
        raise EmbodimentError(f"{where}: target_rotations {list(run.rotations)} are not supported (q99-normalized keys only)")
    if run.normalization_modes is None:
        return  # no pipeline in the run's config: upstream's definitions normalize every key with q99
    for kind, keys in (("state", modalities.states), ("action", modalities.actions)):
        for key in keys:
            mode = run.normalization_modes.get(f"{kind}.{key}")
            if mode != "q99":
                shown = "no normalization mode" if mode is None else f"normalization mode {mode!r}"
                raise EmbodimentError(f"{where}: {kind}.{key} has {shown}; this server implements q99 only")


def _check_relative(tag: str, relative: tuple[str, ...], states: tuple[Part, ...], actions: tuple[Part, ...]) -> None:
    state_dims = {p.name: p.dim for p in states}
    action_dims = {p.name: p.dim for p in actions}
    for key in relative:
        if key not in action_dims:
            continue  # upstream skips a relative key that is not an action key
        if state_dims.get(key) != action_dims[key]:
            got = "no such state key" if key not in state_dims else f"a state of {state_dims[key]}"
            raise EmbodimentError(
                f"embodiment {tag!r}: relative action key {key!r} ({action_dims[key]} dims) needs a state key of the same "
                f"name and width to be added back, got {got}"
            )
