"""The task model (``ardiff_sim.task_model``), on a short run: the loss it trains falls on batches it never saw, the weights it writes
load and serve, and a continuation's frozen prefix is exact on the trained model (the benchmark's full run is cached
and minutes long; this is the same code for a few steps)."""

from __future__ import annotations

import numpy as np

from ardiff_policies.continuation import Continuation
from ardiff_policies.dreamzero.model import DreamZeroModel
from ardiff_policies.observation import RobotObservation
from ardiff_sim import task_model, tiny_task

STEPS = 24


def test_a_short_training_run_lowers_the_held_out_loss_and_its_checkpoint_serves_continuations(tmp_path):
    checkpoint = task_model.write_task_checkpoint(tmp_path / "task")
    untrained = DreamZeroModel.load(checkpoint).dit.state_dict()
    before = task_model.held_out_loss(checkpoint, batches=2)
    lines: list[str] = []
    task_model.train(checkpoint, STEPS, log=lines.append, batch_size=8)
    after = task_model.held_out_loss(checkpoint, batches=2)
    assert lines[-1].startswith(f"step {STEPS}/{STEPS}: loss ")
    assert after < 0.8 * before, (before, after)

    model = DreamZeroModel.load(checkpoint)  # the trained weights, through the server's loader
    assert any(not np.array_equal(value.numpy(), untrained[name].numpy()) for name, value in model.dit.state_dict().items())
    policy, cache = task_model.task_policy(model, checkpoint, "inpaint")
    joints = tiny_task.random_state(np.random.default_rng(0))

    def observe(joints: np.ndarray, continuation: Continuation | None = None) -> RobotObservation:
        view = tiny_task.render(joints, tiny_task.VIEW)[None]
        return RobotObservation(
            exterior_left=view,
            exterior_right=view,
            wrist=view,
            joint_position=joints.astype(np.float32),
            gripper_position=np.array([0.5], np.float32),
            prompt=tiny_task.PROMPT,
            continuation=continuation,
        )

    session = policy.start_session("t", cache.open_session("t"))
    first = policy.step(session, observe(joints))
    second = policy.step(session, observe(first.actions[5, :7].astype(np.float64), Continuation(6, 4, 1)))
    assert second.chunk.frozen == 4 and np.array_equal(second.actions[:4], first.actions[6:10])
    policy.end_session(session)
    cache.end_session(session.kv)
