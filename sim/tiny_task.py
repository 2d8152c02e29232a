"""A synthetic robot task whose motion is smooth and depends on the observation (for the trained tiny DreamZero).

DROID's action space (7 joints relative to the joint state, an absolute gripper). Joints (0, 1), (2, 3) and
(4, 5) are three 2-D oscillators: each control step rotates the pair about the origin by its own angle and
relaxes its radius towards ``RADIUS``; joint 6 follows pair 0's angle and the gripper opens and closes with
it. The expert's chunk from a state is the next ``HORIZON`` states of that motion.

An episode turns one way or the other (``direction`` +1 / -1, both in the data), and one joint state does not
say which: the chunk depends on the observation (where the circles are) and on the motion under way, like a
real task with two ways to do it. A policy must commit to a direction; chunks sampled afresh may take the
other one at a seam, and a continuation that reads the actions being executed keeps the one under way. (When
the state alone determines the chunk, the ideal denoiser's rows ignore each other and a frozen prefix cannot
steer the rest: docs/design-notes.md.)

:class:`SimulatedRobot` is a robot on the task, the client side of a bench: it goes exactly where its actions say
and its cameras render its joints. Numpy only. Used by ``ardiff_sim.task_model`` (training data, statistics) and
the benches (``scripts/bench_async.py``: the robot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HORIZON = 24
SPEEDS = (0.06, -0.045, 0.035)  # radians per control step, per joint pair
RADIUS = 0.8
RELAX = 0.08
PROMPT = "trace the circles"
VIEW = (48, 80)  # (height, width) of every camera view, the task model's view_size


def step(joints: np.ndarray, direction: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """One control step of the expert: next joint targets (..., 7) and the gripper (...) for states (..., 7) turning
    ``direction`` (+1 / -1, scalar or (...))."""
    joints = np.asarray(joints, dtype=np.float64)
    nxt = joints.copy()
    for pair, speed in enumerate(SPEEDS):
        x, y = joints[..., 2 * pair], joints[..., 2 * pair + 1]
        radius, angle = np.hypot(x, y), np.arctan2(y, x)
        radius = radius + RELAX * (RADIUS - radius)
        angle = angle + direction * speed
        nxt[..., 2 * pair], nxt[..., 2 * pair + 1] = radius * np.cos(angle), radius * np.sin(angle)
    angle0 = np.arctan2(nxt[..., 1], nxt[..., 0])
    nxt[..., 6] = 0.3 * np.sin(angle0)
    return nxt, 0.5 + 0.4 * np.cos(angle0)


def expert_chunk(joints: np.ndarray, direction: np.ndarray | float = 1.0) -> np.ndarray:
    """(..., HORIZON, 8) absolute targets, joints and gripper, from states (..., 7) turning ``direction``."""
    state = np.asarray(joints, dtype=np.float64)
    out = np.zeros((*state.shape[:-1], HORIZON, 8))
    for k in range(HORIZON):
        state, gripper = step(state, direction)
        out[..., k, :7], out[..., k, 7] = state, gripper
    return out


def random_state(rng: np.random.Generator, size: int | None = None) -> np.ndarray:
    """Joint states the robot may be in ((7,) or (size, 7)): pairs at any angle, radius around RADIUS; joint 6 on its range."""
    n = 1 if size is None else size
    radius, angle = rng.uniform(0.4, 1.1, (n, 3)), rng.uniform(-np.pi, np.pi, (n, 3))
    joints = np.zeros((n, 7))
    joints[:, 0:6:2], joints[:, 1:6:2] = radius * np.cos(angle), radius * np.sin(angle)
    joints[:, 6] = rng.uniform(-0.35, 0.35, n)
    return joints[0] if size is None else joints


def random_direction(rng: np.random.Generator, size: int) -> np.ndarray:
    """Each sample's direction of turn: +1 or -1, equally likely."""
    return rng.choice([-1.0, 1.0], size)


def statistics(samples: int = 4000, seed: int = 0) -> dict:
    """metadata.json statistics (q01 / q99) of the task: state (absolute) and actions (joints relative)."""
    rng = np.random.default_rng(seed)
    states = random_state(rng, samples)
    chunks = expert_chunk(states, random_direction(rng, samples))
    relative = (chunks[..., :7] - states[:, None]).reshape(-1, 7)
    gripper = chunks[..., 7].reshape(-1)

    def stats(values: np.ndarray) -> dict:
        q01, q99 = np.quantile(values, 0.01, axis=0), np.quantile(values, 0.99, axis=0)
        return {
            "q01": q01.tolist(),
            "q99": q99.tolist(),
            "mean": values.mean(0).tolist(),
            "std": values.std(0).tolist(),
            "min": values.min(0).tolist(),
            "max": values.max(0).tolist(),
        }

    return {
        "state": {"joint_position": stats(states), "gripper_position": stats(np.linspace(0.0, 1.0, 101)[:, None])},
        "action": {"joint_position": stats(relative), "gripper_position": stats(gripper[:, None])},
    }


def render(joints: np.ndarray, size: tuple[int, int] = VIEW) -> np.ndarray:
    """A camera view of the arm: one bright dot per joint pair at its (x, y) (the model may use it or the state)."""
    h, w = size
    image = np.full((h, w, 3), 40, dtype=np.uint8)
    for pair, color in enumerate(((230, 60, 60), (60, 230, 60), (60, 60, 230))):
        x, y = joints[2 * pair], joints[2 * pair + 1]
        col, row = int((x + 1.2) / 2.4 * (w - 1)), int((y + 1.2) / 2.4 * (h - 1))
        image[max(row - 2, 0) : row + 3, max(col - 2, 0) : col + 3] = color
    return image


@dataclass
class SimulatedRobot:
    """A DROID-keyed robot on the task: ``act`` moves it exactly to the action's joints and gripper, ``observe``
    renders its joints into all three cameras (the ``observe`` / ``act`` of ``ardiff_client.async_runner``)."""

    joints: np.ndarray  # (7,) joint state
    gripper: float = 0.5
    view: tuple[int, int] = VIEW

    def observe(self) -> dict[str, np.ndarray]:
        """The observation keys of an infer request (DreamZero-DROID's camera keys)."""
        view = render(self.joints, self.view)
        return {
            "observation/exterior_image_0_left": view,
            "observation/exterior_image_1_left": view,
            "observation/wrist_image_left": view,
            "observation/joint_position": self.joints.astype(np.float32),
            "observation/gripper_position": np.array([self.gripper], np.float32),
        }

    def act(self, action: np.ndarray) -> None:
        """Execute one (8,) action: absolute joint targets, then the gripper."""
        self.joints, self.gripper = action[:7].astype(np.float64), float(action[7])
