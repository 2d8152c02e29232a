"""FlowUniPCSampler against numbers recorded from DreamZero's upstream scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from ardiff_policies.wan.samplers import FlowUniPCSampler
from tests.helpers.reference import REFERENCE_DIR
from tests.helpers.server_harness import REPO

REFERENCE_PATH = REFERENCE_DIR / "flow_unipc_reference.json"
CASES = ["steps16_shift5.0", "steps4_shift5.0", "steps1_shift5.0", "steps16_shift1.0"]
ATOL = 1e-12
# MKL picks its code path by CPU, and its AVX2 / AVX-512 paths (fused multiply-adds) round the small linear solve
# UniPC's corrector makes each step differently: float64 trajectories move up to ~1e-7 off the numbers recorded from
# upstream, which MKL's AVX path reproduces bit for bit. So the exact comparison runs in a subprocess pinned to that
# path (MKL_CBWR=AVX; 4x slower matmuls, so not for the whole suite), and this process's own path is held to CPU_ATOL.
CPU_ATOL = 1e-6


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    if not REFERENCE_PATH.is_file():
        pytest.skip(f"reference numbers are missing: {REFERENCE_PATH} (recorded from upstream DreamZero)")
    return json.loads(REFERENCE_PATH.read_text())


def _tensor(values: list[float], shape: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def _velocity(x: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The reference's stand-in model: v(x, sigma) = (x - x0) / max(sigma, 1e-3) + 0.1 sin(3x)."""
    return (x - x0) / max(sigma.item(), 1e-3) + 0.1 * torch.sin(3 * x)


def _sample(
    sampler: FlowUniPCSampler,
    x: torch.Tensor,
    x0: torch.Tensor,
    num_inference_steps: int,
    shift: float,
    reused_velocity_at_steps: frozenset[int] = frozenset(),
) -> list[torch.Tensor]:
    """Runs a full trajectory; at the listed steps the previous velocity is reused (DiT step cache)."""
    sampler.set_timesteps(num_inference_steps, shift)
    samples = []
    velocity = None
    for step_index in range(num_inference_steps):
        if step_index not in reused_velocity_at_steps:
            velocity = _velocity(x, x0, sampler.sigmas[step_index]).to(x.dtype)
        x = sampler.step(velocity, x, step_index)
        samples.append(x)
    return samples


@pytest.mark.parametrize("case_name", CASES)
def test_schedule_matches_upstream(reference: dict[str, Any], case_name: str) -> None:
    case = reference["cases"][case_name]
    sampler = FlowUniPCSampler()
    sampler.set_timesteps(case["num_inference_steps"], case["shift"])

    assert sampler.timesteps.dtype == torch.int64
    assert sampler.timesteps.tolist() == [int(t) for t in case["timesteps"]]
    assert sampler.sigmas.dtype == torch.float32  # upstream keeps sigmas in float32
    expected_sigmas = torch.tensor(case["sigmas"], dtype=torch.float64)
    torch.testing.assert_close(sampler.sigmas.double(), expected_sigmas, rtol=0, atol=ATOL)


def trajectories(reference: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Every case's samples after each step (flattened), and the 4-step run after an abandoned 16-step one."""
    shape = reference["shape"]
    x0, initial = _tensor(reference["x0"], shape), _tensor(reference["initial_sample"], shape)
    out = {}
    for name in CASES:
        case = reference["cases"][name]
        reused = frozenset(case["reused_velocity_at_steps"])
        samples = _sample(FlowUniPCSampler(), initial, x0, case["num_inference_steps"], case["shift"], reused)
        out[name] = [sample.flatten().tolist() for sample in samples]
    out["after_reset"] = [sample.flatten().tolist() for sample in _resets(FlowUniPCSampler(), initial, x0)[1]]
    return out


@pytest.fixture(scope="module")
def pinned(reference: dict[str, Any]) -> dict[str, list[list[float]]]:
    """``trajectories`` computed on MKL's AVX path (a subprocess: MKL reads MKL_CBWR once, at start)."""
    code = "import json, sys; from tests.policies.test_samplers import trajectories; print(json.dumps(trajectories(json.load(open(sys.argv[1])))))"
    env = {**os.environ, "MKL_CBWR": "AVX"}
    result = subprocess.run([sys.executable, "-c", code, str(REFERENCE_PATH)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _assert_trajectory(samples: list[torch.Tensor], expected: list[list[float]], shape: list[int], atol: float, where: str) -> None:
    assert len(samples) == len(expected)
    for step_index, (sample, want) in enumerate(zip(samples, expected)):
        assert sample.dtype == torch.float64
        torch.testing.assert_close(sample, _tensor(want, shape), rtol=0, atol=atol, msg=lambda m, i=step_index: f"{where}, step {i}: {m}")


@pytest.mark.parametrize("case_name", CASES)
def test_trajectory_matches_upstream(reference: dict[str, Any], pinned: dict[str, list[list[float]]], case_name: str) -> None:
    case = reference["cases"][case_name]
    shape = reference["shape"]
    x0 = _tensor(reference["x0"], shape)
    initial = _tensor(reference["initial_sample"], shape)

    samples = _sample(
        FlowUniPCSampler(),
        initial,
        x0,
        case["num_inference_steps"],
        case["shift"],
        frozenset(case["reused_velocity_at_steps"]),
    )
    expected = case["samples_after_each_step"]
    _assert_trajectory([_tensor(s, shape) for s in pinned[case_name]], expected, shape, ATOL, "MKL's AVX path")
    _assert_trajectory(samples, expected, shape, CPU_ATOL, "this CPU's MKL path")


def _resets(sampler: FlowUniPCSampler, initial: torch.Tensor, x0: torch.Tensor) -> tuple[list, list, list]:
    """A 16-step run, an abandoned one, a 4-step run and the 16-step run again, on one sampler."""
    first = _sample(sampler, initial, x0, 16, 5.0)
    # An abandoned trajectory and a different step count in between must leave no trace.
    sampler.set_timesteps(16, 5.0)
    sampler.step(_velocity(initial, x0, sampler.sigmas[0]), initial, 0)
    sampler.step(_velocity(initial, x0, sampler.sigmas[1]), initial, 1)
    four_steps = _sample(sampler, initial, x0, 4, 5.0)
    second = _sample(sampler, initial, x0, 16, 5.0)
    return first, four_steps, second


def test_set_timesteps_resets_state(reference: dict[str, Any], pinned: dict[str, list[list[float]]]) -> None:
    shape = reference["shape"]
    x0 = _tensor(reference["x0"], shape)
    initial = _tensor(reference["initial_sample"], shape)
    first, four_steps, second = _resets(FlowUniPCSampler(), initial, x0)

    for a, b in zip(first, second):
        assert torch.equal(a, b)
    expected_four = reference["cases"]["steps4_shift5.0"]["samples_after_each_step"]
    _assert_trajectory([_tensor(s, shape) for s in pinned["after_reset"]], expected_four, shape, ATOL, "MKL's AVX path")
    _assert_trajectory(four_steps, expected_four, shape, CPU_ATOL, "this CPU's MKL path")


def test_single_step_returns_x0_prediction() -> None:
    # One step goes straight to sigma = 0, where UniPC's update reduces to x0 = x - sigma * v.
    x = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    velocity = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sampler = FlowUniPCSampler()
    sampler.set_timesteps(1, 5.0)
    expected = x - sampler.sigmas[0].double() * velocity
    torch.testing.assert_close(sampler.step(velocity, x, 0), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1, 16, 2, 4, 6), torch.bfloat16), ((1, 16, 2, 4, 6), torch.float32), ((2, 24, 32), torch.float32)],
)
def test_dtype_and_shape_preserved(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=generator, dtype=torch.float64)
    initial = torch.randn(shape, generator=generator, dtype=torch.float64)

    low_precision = _sample(FlowUniPCSampler(), initial.to(dtype), x0, 8, 5.0, frozenset({3}))
    full_precision = _sample(FlowUniPCSampler(), initial, x0, 8, 5.0, frozenset({3}))

    for sample in low_precision:
        assert sample.dtype == dtype
        assert sample.shape == shape
    # The same trajectory, only rounded: it must land near the float64 one.
    torch.testing.assert_close(low_precision[-1].double(), full_precision[-1], rtol=0, atol=0.1)


def test_steps_must_follow_set_timesteps_in_order() -> None:
    x = torch.zeros(1, 4)
    sampler = FlowUniPCSampler()
    with pytest.raises(RuntimeError, match="set_timesteps"):
        sampler.step(x, x, 0)
    sampler.set_timesteps(4, 5.0)
    with pytest.raises(ValueError, match="in order"):
        sampler.step(x, x, 1)
    sampler.step(x, x, 0)
    with pytest.raises(ValueError, match="in order"):
        sampler.step(x, x, 0)


def test_a_constraint_is_what_the_solver_carries_on_from() -> None:
    """Inpainting pins rows of the sample at every step. UniPC's corrector recomputes the sample from the previous
    one (diffusers' step ignores the ``sample`` it is handed from the second step on), so an edit made before
    ``step`` never reaches the trajectory; ``constrain`` is applied after the corrector. Reference, in closed form:
    a model that predicts x0 = 0 everywhere (v = x / sigma) makes every UniPC update ``x -> sigma_next / sigma * x``
    (all x0 terms vanish), so each step returns the pinned row scaled by that ratio."""
    torch.manual_seed(0)
    sampler = FlowUniPCSampler()
    sampler.set_timesteps(8, shift=5.0)
    sigmas = sampler.sigmas.double()
    eps = torch.randn(1, 4, 3, dtype=torch.float64)
    target = torch.randn(1, 4, 3, dtype=torch.float64)

    def pin(sigma: float):
        def constrain(x: torch.Tensor) -> torch.Tensor:
            out = x.clone()
            out[:, 0] = (1 - sigma) * target[:, 0] + sigma * eps[:, 0]
            return out

        return constrain

    sample, free = eps.clone(), eps.clone()
    for i in range(len(sampler.timesteps) - 1):
        sigma, ratio = float(sigmas[i]), float(sigmas[i + 1] / sigmas[i])
        velocity = pin(sigma)(sample) / sigma
        sample = sampler.step(velocity, sample, i, constrain=pin(sigma))
        pinned = (1 - sigma) * target[:, 0] + sigma * eps[:, 0]
        torch.testing.assert_close(sample[:, 0], ratio * pinned, rtol=0, atol=1e-6)  # the solver's coefficients are float32
        free = ratio * free
        torch.testing.assert_close(sample[:, 1:], free[:, 1:], rtol=0, atol=1e-6)  # the solver's coefficients are float32

    # Without the hook the same edit made before step is lost from the second step on.
    sampler.set_timesteps(8, shift=5.0)
    sample = eps.clone()
    for i in range(2):
        sigma = float(sigmas[i])
        edited = pin(sigma)(sample)
        sample = sampler.step(edited / sigma, edited, i)
    pinned = (1 - float(sigmas[1])) * target[:, 0] + float(sigmas[1]) * eps[:, 0]
    assert not torch.allclose(sample[:, 0], float(sigmas[2] / sigmas[1]) * pinned, atol=1e-3)
