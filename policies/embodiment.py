"""A robot embodiment as data (torch-free: the front end decodes requests by its schema).

An :class:`Embodiment` is what a policy needs to know about one robot: its cameras (in the order
the model was trained to lay them out), its state and action keys with their dimensions, which
action keys are relative to the state of the same name, their q01 / q99 normalization statistics,
its embodiment id and its prompt template. Policies build one at start-up from built-in
definitions and the checkpoint (``policies/dreamzero/embodiments.py`` for DreamZero), and the
server learns the client-facing part, :class:`ObservationSchema`, from ``PolicyInfo``.

The wire (documented in the README, "Your own robot"): DROID keeps RoboArena's keys. Every other
embodiment's request carries, besides ``prompt`` and ``session_id``,

* ``observation/<camera>``: uint8 RGB (H, W, 3) or a frame stack (T, H, W, 3), one per camera;
* ``observation/<state key>``: ``dim`` numbers, shape (dim,) or (1, dim);

where ``<camera>`` and ``<state key>`` are the names after the modality prefix in the training
run's modality config (``video.top_head`` -> ``observation/top_head``, ``state.left_joint_pos`` ->
``observation/left_joint_pos``). The reply's ``actions`` is (horizon, action_dim): the action keys
concatenated in order, ``action_split`` (in the metadata frame and ``GET /info``) says which columns
are which key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ardiff_policies.errors import StartRefused

OBSERVATION_PREFIX = "observation/"
Layout = Literal["droid", "grid", "single"]
Wire = Literal["roboarena", "keys"]


class EmbodimentError(StartRefused, ValueError):
    """The checkpoint (or config) does not define an embodiment this server can serve; one line naming
    what is missing and where it is read from. A ValueError for preflight's one-line config errors, a
    StartRefused for a worker's (no traceback: it is a setting, not a bug)."""


@dataclass(frozen=True)
class Part:
    """One state or action key and its width."""

    name: str
    dim: int


@dataclass(frozen=True)
class QuantileStats:
    """q01 / q99 of the concatenated keys (one entry per dimension)."""

    q01: tuple[float, ...]
    q99: tuple[float, ...]

    @property
    def dim(self) -> int:
        return len(self.q01)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.q01, dtype=np.float64), np.asarray(self.q99, dtype=np.float64)


def _splits(parts: tuple[Part, ...]) -> dict[str, tuple[int, int]]:
    out, start = {}, 0
    for part in parts:
        out[part.name] = (start, start + part.dim)
        start += part.dim
    return out


@dataclass(frozen=True)
class ObservationSchema:
    """What a client of an embodiment sends: one image per camera and one vector per state key, each
    under ``observation/<name>`` (every key required). Picklable and torch-free: the front end decodes
    requests by it. ``resolutions`` (height, width) per camera are advertised, not enforced: any size works."""

    embodiment: str
    cameras: tuple[str, ...]
    states: tuple[Part, ...]
    resolutions: tuple[tuple[int, int], ...]

    @staticmethod
    def key(name: str) -> str:
        return OBSERVATION_PREFIX + name

    def describe(self) -> dict[str, Any]:
        """The observation part of the metadata frame and of ``GET /info``."""
        return {
            "cameras": [
                {"name": name, "key": self.key(name), "resolution": list(size), "dtype": "uint8", "shape": "(H, W, 3) or (T, H, W, 3)"}
                for name, size in zip(self.cameras, self.resolutions, strict=True)
            ],
            "state": [{"name": p.name, "key": self.key(p.name), "dim": p.dim, "shape": f"({p.dim},) or (1, {p.dim})"} for p in self.states],
            "prompt": "prompt",
            "session_id": "session_id",
        }


@dataclass(frozen=True)
class Embodiment:
    """One robot as the model was trained on it. Build it with ``ardiff_policies.dreamzero.embodiments.resolve``."""

    tag: str  # the embodiment tag of the training run (metadata.json's key)
    cameras: tuple[str, ...]  # in the order the model lays them out
    states: tuple[Part, ...]  # concatenated in this order into the model's state vector
    actions: tuple[Part, ...]  # the model's action columns, in this order
    relative_action_keys: tuple[str, ...]  # action keys predicted relative to the same-named state
    state_stats: QuantileStats
    action_stats: QuantileStats
    embodiment_id: int | None  # upstream's projector index of the tag (embodiment_tag_to_projector_index)
    prompt_template: str  # "... {task} ..."
    default_instruction: str  # the instruction when a client sends no prompt (upstream's eval transform)
    layout: Layout  # how the cameras are stitched onto the model's canvas
    wire: Wire = "keys"  # "roboarena": DROID's RoboArena keys; "keys": observation/<name>
    camera_resolutions: tuple[tuple[int, int] | None, ...] = ()  # (height, width) from metadata.json, per camera
    crop_scale: float = 0.95
    trained_view_size: tuple[int, int] | None = None  # the run's per-view resize (height, width), if known
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # where each part was read from

    def __post_init__(self) -> None:
        names = [*self.cameras, *(p.name for p in self.states)]
        if len(set(names)) != len(names):
            raise EmbodimentError(f"embodiment {self.tag}: camera and state names must be distinct, got {names}")
        if self.state_stats.dim != self.state_dim or self.action_stats.dim != self.action_dim:
            raise EmbodimentError(f"embodiment {self.tag}: statistics do not match the key dimensions")

    @property
    def state_dim(self) -> int:
        return sum(p.dim for p in self.states)

    @property
    def action_dim(self) -> int:
        return sum(p.dim for p in self.actions)

    @property
    def state_slices(self) -> dict[str, tuple[int, int]]:
        return _splits(self.states)

    @property
    def action_slices(self) -> dict[str, tuple[int, int]]:
        return _splits(self.actions)

    def action_split(self) -> list[dict[str, Any]]:
        """Which reply columns belong to which action key (listed once, in the metadata frame and /info)."""
        return [
            {"name": name, "start": start, "stop": stop, "dim": stop - start, "relative_to_state": name in self.relative_action_keys}
            for name, (start, stop) in self.action_slices.items()
        ]

    def schema(self, default_resolution: tuple[int, int]) -> ObservationSchema:
        sizes = [r if r is not None else tuple(default_resolution) for r in self.camera_resolutions] or [tuple(default_resolution)] * len(
            self.cameras
        )
        return ObservationSchema(self.tag, self.cameras, self.states, tuple(sizes))  # type: ignore[arg-type]

    def raw_state(self, states: Mapping[str, Any]) -> np.ndarray:
        """The concatenated state vector (float64) from an observation's states; a missing key is zeros."""
        parts = []
        for part in self.states:
            value = states.get(part.name)
            parts.append(np.zeros(part.dim) if value is None else np.asarray(value, dtype=np.float64).reshape(part.dim))
        return np.concatenate(parts) if parts else np.zeros(0)

    def describe(self, default_resolution: tuple[int, int]) -> dict[str, Any]:
        """For ``GET /info``: everything a client or operator needs, and where it came from."""
        return {
            "tag": self.tag,
            "embodiment_id": self.embodiment_id,
            "wire": self.wire,
            "layout": self.layout,
            "observation": self.schema(default_resolution).describe() if self.wire == "keys" else "RoboArena's DROID keys",
            "state": [{"name": p.name, "dim": p.dim} for p in self.states],
            "action_split": self.action_split(),
            "relative_action_keys": list(self.relative_action_keys),
            "prompt_template": self.prompt_template,
            "sources": dict(self.sources),
        }


def metadata_frame(
    embodiment: Embodiment,
    schema: ObservationSchema,
    action_horizon: int,
    frames_per_call: Mapping[str, Any] | None = None,
    *,
    continuations: bool = False,
) -> dict[str, Any]:
    """The metadata frame a client of a non-DROID embodiment receives on connect: what to send, what
    comes back. (DROID's is RoboArena's ``PolicyServerConfig``, ``ardiff_policies.info.droid_server_config``.)"""
    return {
        "embodiment": embodiment.tag,
        "observation": schema.describe(),
        **({"frames_per_call": dict(frames_per_call)} if frames_per_call is not None else {}),
        "actions": {"horizon": action_horizon, "dim": embodiment.action_dim, "split": embodiment.action_split()},
        "needs_session_id": True,
        "continuations": continuations,  # whether a request may carry a continuation (docs/spec.md)
        "image_resolution": list(schema.resolutions[0]) if schema.resolutions else None,
    }


# --------------------------------------------------------------------------- metadata.json


def metadata_tags(metadata: Mapping[str, Any]) -> list[str]:
    return [tag for tag, entry in metadata.items() if isinstance(entry, Mapping)]


def choose_tag(metadata: Mapping[str, Any], wanted: str | None, *, fallback: str = "oxe_droid") -> str:
    """The embodiment tag to serve: ``wanted``, or the only one in metadata.json (``fallback`` when it is
    one of several, for checkpoints served before embodiments were configurable)."""
    tags = metadata_tags(metadata)
    if wanted is not None:
        if wanted not in tags:
            raise EmbodimentError(
                f"policy.embodiment: experiment_cfg/metadata.json has no {wanted!r}; it holds {tags} (--set policy.embodiment=<one of them>)"
            )
        return wanted
    if len(tags) == 1:
        return tags[0]
    if fallback in tags:
        return fallback
    raise EmbodimentError(f"experiment_cfg/metadata.json holds {len(tags)} embodiments {tags}; choose one: --set policy.embodiment=<tag>")


def read_statistics(
    metadata: Mapping[str, Any], tag: str, kind: Literal["state", "action"], keys: tuple[str, ...]
) -> tuple[tuple[Part, ...], QuantileStats]:
    """The keys' dimensions and concatenated q01 / q99 from ``metadata.json[tag].statistics[kind]``."""
    where = f"experiment_cfg/metadata.json {tag}.statistics.{kind}"
    try:
        table = metadata[tag]["statistics"][kind]
    except (KeyError, TypeError):
        raise EmbodimentError(f"{where} is missing (the training run writes it)") from None
    parts, q01, q99 = [], [], []
    for key in keys:
        entry = table.get(key) if isinstance(table, Mapping) else None
        low, high = (entry or {}).get("q01"), (entry or {}).get("q99")
        if not isinstance(low, list) or not isinstance(high, list) or len(low) != len(high) or not low:
            raise EmbodimentError(f"{where}.{key}: expected q01 and q99 lists of equal length, got {'nothing' if entry is None else sorted(entry)}")
        if any(isinstance(v, list) for v in low):
            raise EmbodimentError(f"{where}.{key}: per-horizon statistics (relative_action_per_horizon) are not supported")
        shape = _declared_shape(metadata, tag, kind, key)
        if shape is not None and shape != len(low):
            raise EmbodimentError(f"{where}.{key}: {len(low)} statistics for a key of shape ({shape},) in modalities.{kind}")
        parts.append(Part(key, len(low)))
        q01 += [float(v) for v in low]
        q99 += [float(v) for v in high]
    return tuple(parts), QuantileStats(tuple(q01), tuple(q99))


def _declared_shape(metadata: Mapping[str, Any], tag: str, kind: str, key: str) -> int | None:
    try:
        shape = metadata[tag]["modalities"][kind][key]["shape"]
    except (KeyError, TypeError):
        return None
    return int(shape[0]) if isinstance(shape, list) and len(shape) == 1 else None


def camera_resolutions(metadata: Mapping[str, Any], tag: str, cameras: tuple[str, ...]) -> tuple[tuple[int, int] | None, ...]:
    """(height, width) per camera from ``modalities.video[camera].resolution`` (stored as [width, height])."""
    try:
        video = metadata[tag]["modalities"]["video"]
    except (KeyError, TypeError):
        return tuple(None for _ in cameras)
    out: list[tuple[int, int] | None] = []
    for camera in cameras:
        entry = video.get(camera) if isinstance(video, Mapping) else None
        resolution = entry.get("resolution") if isinstance(entry, Mapping) else None
        if isinstance(resolution, list) and len(resolution) == 2:
            width, height = (int(v) for v in resolution)
            out.append((height, width))
        else:
            out.append(None)
    return tuple(out)
