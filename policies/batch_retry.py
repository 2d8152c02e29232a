"""A batched call whose failure costs only the members that fail alone (both families run their batches through it).

:func:`run_batched` runs one call over several sessions' items at once. If it raises, each member is
retried alone before anything fails: a batch-size out-of-memory or one member's bad input never costs
the others their call, and a member's entry is what it gets alone (its result, or the exception it
raised alone). Two hooks say what the retry needs:

* ``undo``: a call that changes its sessions even when it fails part-way (LingBot-VA: VAE stream caches,
  noise generators, KV pages written before the failing forward) is given a way to put every member
  back as it was before the batched attempt (:class:`Undo`); a call that changes a session only once it
  has succeeded (DreamZero's phases: KV writes abort on error, per-attempt state reset when an attempt
  starts) needs none. A hook that cannot keep an undo for this batch (no spare KV pages) returns None:
  then the members run one after another, each alone from the start (under CFG-parallel it must decide
  alike on every rank: the ranks' agreements pair up one for one).
* ``agree``: under CFG-parallel every rank runs the same batch over its own branch, and the ranks must
  fail the same members, or one would wait in a collective the other never joins. After every attempt
  the ranks agree (one flag per attempt, an any-rank OR: ``Policy.agree``); a rank whose attempt
  succeeded while the other's failed gets :class:`OtherRankFailed`. Without an undo, a rank whose batched
  attempt succeeded has done its part and only joins its retries' agreements (nothing is written twice).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

Agree = Callable[[Sequence[bool]], list[bool]]  # this rank's failed flags -> failed on any rank


class OtherRankFailed(RuntimeError):
    """This rank's part succeeded, the other CFG-parallel rank's failed (its log has the error)."""


class Undo(Protocol):
    """What a batched attempt's members were before it (taken by the ``undo`` hook just before the attempt)."""

    def restore(self) -> None:
        """The attempt failed: put every member back as it was."""

    def release(self) -> None:
        """The attempt succeeded: drop what was kept."""


def one_rank(failed: Sequence[bool]) -> list[bool]:
    """The agreement of a single process: as given."""
    return list(failed)


def run_batched(
    items: Sequence[T],
    run: Callable[[list[T]], Sequence[R]],
    *,
    agree: Agree = one_rank,
    undo: Callable[[list[T]], Undo | None] | None = None,
    name: str | None = None,
) -> list[R | Exception]:
    """``run(items)`` (an entry per item, in order) batched, each item retried alone if the batch fails (see the
    module docstring). Returns an entry per item: its result, or the exception it failed with. ``name`` (for the log):
    what ``run`` does, by default its function name."""
    items = list(items)
    if not items:
        return []
    name = name or getattr(run, "__name__", "call").strip("_")
    if len(items) == 1:
        return [_alone(items[0], run, agree, name)]
    kept = None
    if undo is not None:
        try:
            kept = undo(items)  # a hook that fails part-way puts back what it took itself
        except Exception as exc:
            logger.warning("a batched %s: its undo could not be kept (%s: %s); running each alone", name, type(exc).__name__, exc)
        if kept is None:  # nothing kept to restore after a failed attempt: one by one
            return [_alone(item, run, agree, name) for item in items]
    outcome, error = _attempt(items, run, agree, name)
    if error is None:
        if kept is not None:
            kept.release()
        return list(outcome)
    if kept is not None:
        kept.restore()
        outcome = None  # put back on this rank too: its retries run again
    logger.warning("a batched %s of %d sessions failed (%s: %s); retrying each alone", name, len(items), type(error).__name__, error)
    if outcome is None:
        return [_alone(item, run, agree, name) for item in items]
    # This rank's batched attempt succeeded (the other rank's failed): its entries stand unless the other rank's retry fails.
    return [_alone(item, run, agree, name, done=(entry,)) for item, entry in zip(items, outcome)]


def one_by_one(items: Sequence[T], run_one: Callable[[T], R]) -> list[R | Exception]:
    """Each item alone, one after another (a policy without a batched forward): its result, or the exception it raised."""
    return [_alone(item, lambda group: [run_one(group[0])], one_rank, "call") for item in items]


def single(results: Sequence[R | BaseException]) -> R:
    """The entry of a batch of one, raised if it is an exception (a one-member call of a batched API)."""
    (result,) = results
    if isinstance(result, BaseException):
        raise result
    return result


def _alone(item: T, run: Callable[[list[T]], Sequence[R]], agree: Agree, name: str, *, done: tuple[R] | None = None) -> R | Exception:
    """One item's attempt alone; ``done``: its entry from this rank's batched attempt (then this rank only agrees)."""
    outcome, error = _attempt([item], run, agree, name, here=done is None)
    if error is not None:
        return error
    return (outcome if done is None else done)[0]


def _attempt(
    items: list[T], run: Callable[[list[T]], Sequence[R]], agree: Agree, name: str, *, here: bool = True
) -> tuple[Sequence[R] | None, Exception | None]:
    """Run a batched call (``here``: else only agree). Returns its entries where it completed on this rank (else
    None), and its error if it failed on any CFG rank."""
    outcome = None
    error = None
    if here:
        try:
            outcome = run(items)
        except Exception as exc:
            error = exc
    if agree([error is not None])[0]:
        return outcome, error or OtherRankFailed(f"a batched {name} failed on the other CFG-parallel rank")
    return outcome, None
