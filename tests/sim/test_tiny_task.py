"""The simulated robot (``ardiff_sim.tiny_task``): what it sends is a request the server decodes, and it goes exactly
where its actions say."""

from __future__ import annotations

import numpy as np

from ardiff_server.wire.decode import decode_request
from ardiff_sim import tiny_task


def test_the_robot_observes_a_decodable_droid_request_and_follows_its_actions():
    robot = tiny_task.SimulatedRobot(tiny_task.random_state(np.random.default_rng(0)))
    request = {**robot.observe(), "prompt": tiny_task.PROMPT, "session_id": "s", "endpoint": "infer"}
    observation = decode_request(request).observation
    assert observation.exterior_left.shape[-3:] == (*tiny_task.VIEW, 3)
    np.testing.assert_array_equal(observation.exterior_left.reshape(-1), tiny_task.render(robot.joints).reshape(-1))
    np.testing.assert_allclose(observation.joint_position, robot.joints.astype(np.float32))

    chunk = tiny_task.expert_chunk(robot.joints)
    robot.act(chunk[0])
    np.testing.assert_array_equal(robot.joints, chunk[0, :7])
    assert robot.gripper == chunk[0, 7]
    moved = robot.observe()
    assert not np.array_equal(moved["observation/exterior_image_0_left"], request["observation/exterior_image_0_left"])
    assert moved["observation/gripper_position"].tolist() == [np.float32(chunk[0, 7])]
