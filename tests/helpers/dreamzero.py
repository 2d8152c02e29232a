"""The tiny DreamZero policy for tests: observations, a policy with its KV cache, a rollout."""

from __future__ import annotations

import threading

import numpy as np
import torch

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions, StepResult
from ardiff_policies.dreamzero.policy import DreamZeroConfig, DreamZeroPolicy
from ardiff_policies.guidance import Guidance
from ardiff_policies.observation import RobotObservation

TINY = {"view_size": (48, 80)}


def droid_observation(rng: np.random.Generator, frames: int, size: tuple[int, int] = (90, 160), prompt: str = "pick up the cup") -> RobotObservation:
    """A DROID-shaped observation: three cameras of random ``frames`` x ``size`` pictures, random joints, the gripper at 0.3."""
    shape = (frames, *size, 3)
    cam = lambda: rng.integers(0, 256, shape, dtype=np.uint8)  # noqa: E731
    return RobotObservation(
        exterior_left=cam(),
        exterior_right=cam(),
        wrist=cam(),
        joint_position=rng.uniform(-1, 1, 7).astype(np.float32),
        gripper_position=np.array([0.3], np.float32),
        prompt=prompt,
    )


def observations(n: int, seed: int = 0, prompt: str = "pick up the cup"):
    """An episode's ``n`` observations: one frame first, then 4-frame stacks."""
    rng = np.random.default_rng(seed)
    for call in range(n):
        yield droid_observation(rng, 1 if call == 0 else 4, prompt=prompt)


def make_policy(
    tiny_model, branches=None, guidance=None, *, max_batch: int = 1, max_sessions: int = 3, **overrides
) -> tuple[DreamZeroPolicy, PagedKVCache]:
    options = RuntimeOptions(guidance=guidance or Guidance.single(), max_batch=max_batch)
    policy = DreamZeroPolicy(DreamZeroConfig(**{**TINY, **overrides}), options, model=tiny_model)
    branches = branches or policy.branches
    spec = policy.kv_spec()
    pages = max_sessions * len(branches) * spec.pages_per_branch + 1
    cache = PagedKVCache(spec, num_pages=pages, max_sessions=max_sessions, branches=branches, max_batch=max_batch)
    return policy, cache


def rollout(policy, cache, obs, session_id="s"):
    session = policy.start_session(session_id, cache.open_session(session_id))
    results = [policy.step(session, o) for o in obs]
    return session, results


def each_alone(policy, cache, episodes: dict[str, list[RobotObservation]]) -> dict[str, list[StepResult]]:
    """Every episode stepped call by call in a session of its own (``alone-<name>``), ended after: the reference a
    batch is held to."""
    alone = {}
    for name, episode in episodes.items():
        session = policy.start_session(f"alone-{name}", cache.open_session(f"alone-{name}"))
        alone[name] = [policy.step(session, o) for o in episode]
        policy.end_session(session)
        cache.end_session(session.kv)
    return alone


def batched(policy, cache, episodes: dict[str, list[RobotObservation]], joins: dict[str, int] | None = None) -> dict[str, list[StepResult]]:
    """The episodes stepped together, one ``step_batch`` a round: an episode joins in round ``joins[name]`` (0 by
    default) and leaves after its last call; the sessions are ended after. No member may fail."""
    joins = joins or {}
    sessions = {name: policy.start_session(name, cache.open_session(name)) for name in episodes}
    results: dict[str, list[StepResult]] = {name: [] for name in episodes}
    rounds = max(joins.get(name, 0) + len(episode) for name, episode in episodes.items())
    for batch in range(rounds):
        members = [name for name in episodes if 0 <= batch - joins.get(name, 0) < len(episodes[name])]
        stepped = policy.step_batch([(sessions[name], episodes[name][batch - joins.get(name, 0)]) for name in members])
        for name, result in zip(members, stepped, strict=True):
            assert not isinstance(result, BaseException), (name, result)
            results[name].append(result)
    for session in sessions.values():
        policy.end_session(session)
        cache.end_session(session.kv)
    return results


class ThreadPair:
    """Two in-process 'ranks' meeting at a barrier: a stand-in for torch.distributed."""

    def __init__(self, barrier_timeout_s: float = 60.0) -> None:
        self.barrier = threading.Barrier(2, timeout=barrier_timeout_s)
        self.slots: list[torch.Tensor | None] = [None, None]

    def endpoint(self, rank: int):
        pair = self

        class Endpoint:
            def all_gather(self, tensor):
                pair.slots[rank] = tensor.clone()
                pair.barrier.wait()
                out = [s.clone() for s in pair.slots]
                pair.barrier.wait()
                return out

            def broadcast(self, tensor, src):
                if rank == src:
                    pair.slots[src] = tensor.clone()
                pair.barrier.wait()
                out = pair.slots[src].clone()
                pair.barrier.wait()
                return out

        return Endpoint()

    def run(self, rank_fn, timeout_s: float = 240.0) -> None:
        """``rank_fn(rank)`` on two threads, as two processes would run; a failure on one aborts the other's waits.
        Raises the first failure, or if a rank is still waiting for the other after ``timeout_s``."""
        errors: list[BaseException] = []

        def guarded(rank: int) -> None:
            try:
                rank_fn(rank)
            except BaseException as exc:  # surface thread failures in the test
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=guarded, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout_s)
        assert not any(t.is_alive() for t in threads), "a rank is stuck waiting for the other"
        if errors:
            raise errors[0]
