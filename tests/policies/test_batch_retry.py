"""The member-by-member retry both families run their batched calls through (``ardiff_policies.batch_retry``):
only a member that fails alone fails, what the undo hook kept is put back before the retries, and CFG ranks that
disagree about an attempt fail the same members (the families' own suites check it on real models:
tests/engine/test_batching.py, tests/engine/test_scheduler.py, tests/policies/test_lingbot_va_retry.py)."""

from __future__ import annotations

import pytest

from ardiff_policies.batch_retry import OtherRankFailed, one_by_one, run_batched, single


class Members:
    """A batched call over numbers that fails for any batch holding ``bad`` (or, ``batch_only``, any batch of more
    than one), recording what it ran and keeping a state an undo must put back."""

    def __init__(self, bad: int | None = None, batch_only: bool = False) -> None:
        self.bad, self.batch_only = bad, batch_only
        self.runs: list[list[int]] = []
        self.state: list[int] = []  # what the calls wrote, even a failed one's (as LingBot-VA's VAE streams)

    def double(self, items: list[int]) -> list[int]:
        self.runs.append(list(items))
        self.state.extend(items)
        if (self.batch_only and len(items) > 1) or self.bad in items:
            raise RuntimeError(f"batch {items} failed")
        return [2 * x for x in items]


class Kept:
    def __init__(self, members: Members) -> None:
        self.members, self.before, self.done = members, list(members.state), None

    def restore(self) -> None:
        self.members.state[:] = self.before
        self.done = "restored"

    def release(self) -> None:
        self.done = "released"


def test_a_batch_that_succeeds_runs_once_and_releases_what_it_kept():
    members, kept = Members(), []
    assert run_batched([1, 2, 3], members.double, undo=lambda items: kept.append(Kept(members)) or kept[-1]) == [2, 4, 6]
    assert members.runs == [[1, 2, 3]] and kept[0].done == "released"


def test_a_failed_batch_is_put_back_and_only_the_member_that_fails_alone_fails(caplog):
    members, kept = Members(bad=2), []
    out = run_batched([1, 2, 3], members.double, undo=lambda items: kept.append(Kept(members)) or kept[-1])
    assert out[0] == 2 and out[2] == 6 and isinstance(out[1], RuntimeError) and "[2]" in str(out[1])
    assert members.runs == [[1, 2, 3], [1], [2], [3]] and kept[0].done == "restored"
    assert members.state == [1, 2, 3]  # the failed batch's writes were undone before the retries wrote theirs
    assert "a batched double of 3 sessions failed (RuntimeError: batch [1, 2, 3] failed); retrying each alone" in caplog.text


def test_a_failure_of_the_batch_alone_costs_no_member_its_call():
    members = Members(batch_only=True)
    assert run_batched([1, 2], members.double) == [2, 4]
    assert members.runs == [[1, 2], [1], [2]]


def test_without_room_for_an_undo_the_members_run_one_by_one():
    members = Members(batch_only=True)
    assert run_batched([1, 2, 3], members.double, undo=lambda items: None) == [2, 4, 6]
    assert members.runs == [[1], [2], [3]]  # never batched: nothing could be put back

    def breaks(items):
        raise MemoryError("no room to keep the sessions")

    members = Members()
    assert run_batched([1, 2], members.double, undo=breaks) == [2, 4] and members.runs == [[1], [2]]


def test_a_single_member_is_its_own_attempt_and_nothing_is_kept():
    members, kept = Members(bad=5), []
    (out,) = run_batched([5], members.double, undo=lambda items: kept.append(items) or None)
    assert isinstance(out, RuntimeError) and members.runs == [[5]] and kept == []
    assert run_batched([], members.double) == []


class OtherRank:
    """This rank's view of the any-rank OR: ``fails`` says, per agreement in order, whether the other rank failed."""

    def __init__(self, fails: list[bool]) -> None:
        self.fails, self.calls = list(fails), 0

    def __call__(self, failed):
        other = self.fails[self.calls]
        self.calls += 1
        return [f or other for f in failed]


def test_a_rank_whose_batch_succeeded_only_joins_the_other_ranks_retries():
    """The other rank's batched attempt failed, then its retry of member 2: this rank runs nothing again (its part
    was written) and fails member 2 too, naming the other rank."""
    members, agree = Members(), OtherRank([True, False, True, False])
    out = run_batched([1, 2, 3], members.double, agree=agree)
    assert out[0] == 2 and out[2] == 6 and isinstance(out[1], OtherRankFailed) and "other CFG-parallel rank" in str(out[1])
    assert members.runs == [[1, 2, 3]] and agree.calls == 4  # one agreement per attempt, as on the other rank


def test_with_an_undo_both_ranks_retry_after_either_failed():
    members, agree = Members(), OtherRank([True, False, False])
    kept = []
    assert run_batched([1, 2], members.double, agree=agree, undo=lambda items: kept.append(Kept(members)) or kept[-1]) == [2, 4]
    assert members.runs == [[1, 2], [1], [2]] and kept[0].done == "restored"


def test_one_by_one_and_single():
    members = Members(bad=2)
    out = one_by_one([1, 2, 3], lambda x: members.double([x])[0])
    assert out[0] == 2 and isinstance(out[1], RuntimeError) and out[2] == 6
    assert single([7]) == 7
    with pytest.raises(RuntimeError, match="boom"):
        single([RuntimeError("boom")])
