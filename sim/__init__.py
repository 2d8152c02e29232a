"""ardiff_sim: the benches' simulated task, outside the server and the client.

``tiny_task`` (numpy only): a synthetic robot task, its expert, its camera renderer and :class:`SimulatedRobot`.
``task_model`` (torch): the tiny DreamZero trained on it, cached, and served in-process for the benches. Neither the
server packages nor the client import this package (tests/test_layout.py).
"""
