"""Bench only: every batched step takes a modelled GPU time t(b), so a CPU reproduces a GPU's schedule.

``engine.modelled_step_time: 14b | 5b`` wraps the built policy (``builder.py``) in
:class:`ModelledStepPolicy`: a step of ``b`` sessions runs for real, then sleeps the rest of t(b) (a step
that took longer than t(b) is not shortened: the reply's ``session.modelled_step_overrun`` says so). The
actions are the real ones; only time is modelled. The profiles come from the roofline in
``docs/performance.md``:

* ``14b``: t(1) = 0.61 s (vLLM-Omni's 611 ms per chunk, CFG-parallel on two H200s); compute-bound at full
  size (1.0 PFLOP a chunk), so b sessions cost b times one: t(b) = b t(1).
* ``5b``: t(1) = 0.15 s; a forward of 50 tokens per frame leaves the GPU waiting on its 11.2 GB of weights
  (18 DiT forwards at 4.8 TB/s: 42 ms, with VAE, encoders and launches about 0.15 s), so a batch adds
  little: t(b) = t(1) (1 + 0.1 (b - 1)).

Both are a chunk of upstream's 16 denoising steps. A step whose calls ran other counts (a request's
``num_inference_steps``, as each result's ``info`` reports it) lasts t(b) x share(n) per group of b calls
at n steps, the groups one after the other as DreamZero runs them (``StepTimeProfile.seconds``):

  share(n) = (1 - s) + s (1 + m(n)) / (1 + m(16)),

m(n) the denoise steps that run the DiT at n steps under upstream's fixed mask carried over to n
(``ardiff_policies.dreamzero.step_cache.resample_mask``: 8 of 16, 6 of 8, 4 of 4), plus the window's
prefill forward (per CFG branch; the ratio is the same with both branches on one GPU), and s the DiT's
share of a chunk: ``14b`` 0.93 (a steady chunk is 1.0 PFLOP of DiT, 1.014 s at the H200's bf16 peak,
against vLLM-Omni's 1.095 s per chunk on one H200: at least 93 % of the chunk is the DiT), ``5b`` 0.28
(42 ms of DiT in 0.15 s). 14B: share(8) = 0.79, share(4) = 0.59 (t(1) 0.48 s and 0.36 s; DreamZero
PR #78 halved a chunk with 4 steps); 5B: 0.94, 0.88. A model, not a measurement: the non-DiT part
(VAE encode, launches) is taken as fixed, and fewer steps never cost more.

A call's own encodes count inside its t(b). t(1) is a GPU's whole cost of a chunk (vLLM-Omni's 611 ms is an
average over steady calls and window starts alike), so a call whose session-own work (``Policy.prepare`` on the
engine's encoder thread: a first call's prompt, a window start's CLIP and image conditioning) ran just before its
step is charged t(b) from that work's start: its step sleeps ``t(b) - own encode - real step``, the largest member's
encode for a batch (the batch starts when its last member's encode ended). Otherwise a CPU's encode, which on the
tiny task model is 3-4 times its step, would land on top of a GPU's chunk time and the bench would measure the CPU.
A call whose encode and step together exceed t(b) is an overrun like a long step.

``engine.modelled_step_t1_s`` replaces the profile's t(1) (e.g. with a measured one). The option is
refused at start-up unless the config says ``bench: true`` (``config.py``): a server that sleeps on
purpose must never serve robots by accident.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ardiff_kv import Branch, KVSpec, SessionKV
from ardiff_policies.base import Policy, StepResult
from ardiff_policies.dreamzero.config import UPSTREAM_STEP_MASK
from ardiff_policies.dreamzero.step_cache import resample_mask
from ardiff_policies.inference_steps import VIDEO_STEPS_KEY
from ardiff_policies.info import PolicyInfo
from ardiff_policies.observation import RobotObservation

REFERENCE_STEPS = len(UPSTREAM_STEP_MASK)  # the denoising steps of a profile's t(b): upstream's 16


def dit_forwards(steps: int) -> int:
    """DiT forwards per CFG branch of a chunk at ``steps`` denoising steps: the prefill and the steps upstream's fixed
    mask, carried over to ``steps``, runs."""
    return 1 + sum(resample_mask(UPSTREAM_STEP_MASK, steps))


@dataclass(frozen=True, slots=True)
class StepTimeProfile:
    """t(b) = t1_s (1 + per_extra_session (b - 1)): seconds one step of ``b`` sessions takes at upstream's 16 denoising
    steps; at n steps, t(b) x share(n) (the module's docstring)."""

    name: str
    t1_s: float
    per_extra_session: float  # of t(1), what each session past the first adds
    dit_share: float  # of a chunk's time, what its DiT forwards take (the part that scales with the steps)

    def seconds(self, batch: int, steps: int = REFERENCE_STEPS) -> float:
        if batch < 1:
            raise ValueError(f"a step holds at least one session, got {batch}")
        return self.t1_s * (1.0 + self.per_extra_session * (batch - 1)) * self.step_share(steps)

    def step_share(self, steps: int) -> float:
        """A chunk at ``steps`` denoising steps over one at REFERENCE_STEPS."""
        if steps < 1:
            raise ValueError(f"a chunk takes at least one denoising step, got {steps}")
        return (1.0 - self.dit_share) + self.dit_share * dit_forwards(steps) / dit_forwards(REFERENCE_STEPS)

    def at_steps(self, steps: int) -> Callable[[int], float]:
        """t(b) at ``steps`` denoising steps, as a function of b."""
        return lambda batch: self.seconds(batch, steps)

    def formula(self, steps: int = REFERENCE_STEPS) -> str:
        scale = "" if steps == REFERENCE_STEPS else f" x {self.step_share(steps):.3f} ({steps} steps)"
        if self.per_extra_session == 1.0:
            return f"t(b) = b x {self.t1_s:g} s{scale}"
        return f"t(b) = {self.t1_s:g} s x (1 + {self.per_extra_session:g} (b - 1)){scale}"


PROFILES: dict[str, StepTimeProfile] = {
    "14b": StepTimeProfile("14b", 0.61, 1.0, dit_share=0.93),
    "5b": StepTimeProfile("5b", 0.15, 0.1, dit_share=0.28),
}


def step_time_profile(name: str, t1_s: float | None = None) -> StepTimeProfile:
    """The named profile, its t(1) replaced by ``t1_s`` when given."""
    if name not in PROFILES:
        raise ValueError(f"modelled step time profile: expected one of {sorted(PROFILES)}, got {name!r}")
    profile = PROFILES[name]
    return profile if t1_s is None else StepTimeProfile(profile.name, t1_s, profile.per_extra_session, profile.dit_share)


class ModelledStepPolicy(Policy):
    """``inner`` with every step lasting at least ``profile.seconds(batch size)``; everything else is ``inner``'s."""

    def __init__(
        self,
        inner: Policy,
        profile: StepTimeProfile,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner, self.profile = inner, profile
        self.clock, self.sleep = clock, sleep
        # id(session) -> seconds its last prepare job ran (encoder thread writes, engine thread pops at the step)
        self._encode_s: dict[int, float] = {}

    # The engine's interface, passed through.
    @property
    def info(self) -> PolicyInfo:
        return self.inner.info

    def kv_spec(self) -> KVSpec | None:
        return self.inner.kv_spec()

    @property
    def branches(self) -> tuple[Branch, ...]:
        return self.inner.branches

    def check_observation(self, observation: RobotObservation) -> None:
        self.inner.check_observation(observation)

    def start_session(self, session_id: str, kv: SessionKV | None) -> Any:
        return self.inner.start_session(session_id, kv)

    def prepare(self, session: Any, observation: RobotObservation) -> Callable[[], None] | None:
        job = self.inner.prepare(session, observation)
        if job is None:
            return None

        def timed() -> None:  # the call's own encode, counted inside its modelled time (the module's docstring)
            started = self.clock()
            try:
                job()
            finally:
                self._encode_s[id(session)] = self.clock() - started

        return timed

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        return self.inner.agree(failed)

    def end_session(self, session: Any) -> None:
        self._encode_s.pop(id(session), None)
        self.inner.end_session(session)

    def warmup_observations(self) -> Iterator[RobotObservation]:
        return self.inner.warmup_observations()

    def decode_prediction(self, predicted: Any):
        return self.inner.decode_prediction(predicted)

    def __getattr__(self, name: str) -> Any:  # a family's own methods (e.g. LingBot-VA's compute_kv_cache)
        return getattr(self.__dict__["inner"], name)

    # The one thing it changes.
    def step_batch(self, items: Sequence[tuple[Any, RobotObservation]]) -> list[StepResult | BaseException]:
        encode_s = max((self._encode_s.pop(id(session), 0.0) for session, _ in items), default=0.0)
        started = self.clock()
        results = self.inner.step_batch(items)
        real_s = self.clock() - started
        modelled_s = self.modelled_seconds(results)
        self.sleep(max(0.0, modelled_s - encode_s - real_s))
        for result in results:
            if isinstance(result, StepResult):
                result.info["modelled_step_ms"] = round(modelled_s * 1000.0, 3)
                result.info["real_step_ms"] = round(real_s * 1000.0, 3)
                result.info["own_encode_ms"] = round(encode_s * 1000.0, 3)
                result.info["modelled_step_overrun"] = encode_s + real_s > modelled_s
        return results

    def modelled_seconds(self, results: Sequence[StepResult | BaseException]) -> float:
        """t(b) of each group of the step's calls that ran one number of denoising steps (the ``num_inference_steps``
        its result reports; a failed call or a policy that reports none: the profile's 16), one group after the other."""
        steps = Counter(r.info.get(VIDEO_STEPS_KEY, REFERENCE_STEPS) if isinstance(r, StepResult) else REFERENCE_STEPS for r in results)
        return sum(self.profile.seconds(batch, count) for count, batch in steps.items())
