"""The process client's supervision (engine/process_client.py, engine/worker_group.py), without a websocket.

One worker process at a time, driven the way the front end drives it: start-up failure, a worker
that dies mid-request, a step that runs past its timeout, control requests while the worker is
gone, and shutdown with a request in flight.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from ardiff_policies.observation import RobotObservation
from ardiff_server.config import validate_config
from ardiff_server.engine.messages import EngineError, ErrorKind
from ardiff_server.engine.process_client import ProcessClient
from tests.helpers.server_harness import fake_config


def observation(prompt: str = "", joint: float = 0.0) -> RobotObservation:
    return RobotObservation(joint_position=np.full(7, joint, np.float32), prompt=prompt)


def client_for(**overrides) -> ProcessClient:
    raw = fake_config(**overrides)
    raw["engine"] = {**raw["engine"], "shm_mib": 0}
    return ProcessClient(validate_config(raw))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def test_a_worker_that_fails_to_start_is_one_clear_error_and_leaves_nothing_running():
    async def scenario():
        client = client_for(policy={"fail_start": True})
        with pytest.raises(EngineError) as info:
            await client.start()
        assert info.value.kind is ErrorKind.UNAVAILABLE
        assert "worker failed to start: RuntimeError: fake policy refused to start" in str(info.value)
        assert info.value.traceback and "build_fake" in info.value.traceback
        await client.stop(grace_s=1.0)

    asyncio.run(scenario())


def test_supervision_restarts_a_dead_or_stuck_worker_and_fails_only_its_requests():
    async def scenario():
        # one request per step, so "queued behind a stuck step" is well defined (batches: tests/engine/test_batching.py)
        client = client_for(server={"request_timeout_s": 1.5})  # the fake policy never batches
        restarted = []
        client.on_restart = lambda c: restarted.append(c.restarts)
        await client.start()
        assert client.state == "ready" and client.info.model == "fake" and len(client.pids) == 1
        first = await client.infer("s", observation(joint=3.0))
        assert first.new_session and first.actions[0, :2].tolist() == [1.0, 3.0] and first.stats[0].session_ids == ("s",)

        # dies mid-request: that request fails, the worker is restarted, its sessions are gone
        old_pid = client.pids[0]
        with pytest.raises(EngineError) as info:
            await client.infer("s", observation("die"))
        assert info.value.kind is ErrorKind.WORKER_DIED
        assert restarted == [1] and client.state in ("restarting", "ready")
        await client.end("s", "reset")  # nothing to end on a dead worker: done, no error
        await client.detach("s", "disconnected")
        assert await until(lambda: client.state == "ready", 60)
        assert not alive(old_pid) and client.pids[0] != old_pid
        again = await client.infer("s", observation())
        assert again.new_session and again.calls == 1

        # a step past request_timeout_s: TIMEOUT for it, queued requests learn of the restart
        stuck = asyncio.ensure_future(client.infer("s", observation("sleep:30")))
        queued = asyncio.ensure_future(client.infer("other", observation()))
        started = time.monotonic()
        with pytest.raises(EngineError) as info:
            await stuck
        assert info.value.kind is ErrorKind.TIMEOUT and "longer than 2 s" in str(info.value)
        assert time.monotonic() - started < 10
        with pytest.raises(EngineError) as info:
            await queued
        assert info.value.kind is ErrorKind.WORKER_DIED
        assert restarted == [1, 2]
        assert await until(lambda: client.state == "ready", 60)
        assert (await client.infer("s", observation())).new_session

        # shutdown with a request in flight: it fails at once, the process goes away
        pid = client.pids[0]
        slow = asyncio.ensure_future(client.infer("s", observation("sleep:1")))
        await asyncio.sleep(0.2)
        await client.stop(grace_s=3.0)
        with pytest.raises(EngineError) as info:
            await slow
        assert info.value.kind is ErrorKind.UNAVAILABLE and client.state == "stopped"
        assert not alive(pid)
        with pytest.raises(EngineError, match="shutting down"):
            await client.infer("s", observation())

    asyncio.run(scenario())


def test_a_policy_without_a_batched_forward_is_never_batched_and_a_batch_gets_each_members_budget():
    async def scenario(policy_max_batch: int) -> list:
        # request_timeout_s is one request's own compute: 3 x 0.6 s in one step is no timeout
        client = client_for(server={"request_timeout_s": 1.0}, max_batch=4, batch_wait_ms=200, policy={"max_batch": policy_max_batch})
        await client.start()
        try:
            replies = await asyncio.gather(*(client.infer(f"s{i}", observation("sleep:0.6")) for i in range(3)))
            assert client.restarts == 0
            return [reply.batch_size for reply in replies]
        finally:
            await client.stop(grace_s=3.0)

    assert asyncio.run(scenario(1)) == [1, 1, 1]  # engine.max_batch 4, but steps would only queue behind each other
    assert max(asyncio.run(scenario(4))) > 1
