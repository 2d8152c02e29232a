"""scripts/bench_fleet.py: the limit formula, and the bench's smallest form against a real server (one robot, one
configuration, a few chunks under the 14B's modelled step time) printing its table and its capacity line."""

from __future__ import annotations

import re

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_fleet")


def test_the_limit_is_the_most_robots_whose_delay_and_execution_horizon_fit_in_one_chunk(bench):
    from ardiff_server.engine.modelled_step import step_time_profile

    big, small = step_time_profile("14b"), step_time_profile("5b")
    # 14B at 15 Hz: d = ceil(15 x 0.61) = 10; N robots one by one need 10 + 9.15 N <= 24 -> 1, whatever the batch
    assert bench.fleet_limit(big.seconds, hz=15.0, max_batch=1) == 1
    assert bench.fleet_limit(big.seconds, hz=15.0, max_batch=8) == 1
    assert bench.fleet_limit(big.seconds, horizon=48, hz=15.0, max_batch=8) == 4  # 10 + 9.15 x 4 = 46.6 <= 48
    # 5B: one by one 3 + 2.25 N <= 24 -> 9; batches of 4 (t = 0.195 s, d = 3) in 7 rounds -> 28; of 26 in 2 -> 52
    assert bench.fleet_limit(small.seconds, hz=15.0, max_batch=1) == 9
    assert bench.fleet_limit(small.seconds, hz=15.0, max_batch=4) == 28
    assert bench.fleet_limit(small.seconds, hz=15.0, max_batch=64) == 52
    # exactly at the bound: a flat 0.4 s step (d = 6, 6 actions a round) in batches of 2 fits 3 rounds: 6 + 18 = 24
    assert bench.fleet_limit(lambda b: 0.4, hz=15.0, max_batch=2) == 6
    assert bench.fleet_limit(lambda b: 0.4, horizon=23, hz=15.0, max_batch=2) == 4
    # a step slower than half a chunk serves nobody without idling: d + s = 2 x 15 > 24
    assert bench.fleet_limit(lambda b: 1.0, hz=15.0, max_batch=8) == 0


def test_a_rounds_partial_batch_costs_its_own_step_not_a_full_ones(bench):
    """34 robots of the 5B in batches of at most 6: 6 batches a round, 6 6 6 6 5 5 (t(6) = 0.225 s, d = 4), a round of
    4 x 0.225 + 2 x 0.21 = 1.32 s: 4 + 19.8 <= 24 fits. Counting every batch at t(6), as ceil(N / b) t(b) did, makes
    the round 1.35 s (4 + 20.25 > 24) and the limit 30."""
    from ardiff_server.engine.modelled_step import step_time_profile

    small = step_time_profile("5b")
    assert bench.round_batches(34, 6) == [6, 6, 6, 6, 5, 5]
    assert bench.fleet_limit(small.seconds, hz=15.0, max_batch=6) == 34
    assert bench._fits(small.seconds, 34, 6, 24, 15.0) and not bench._fits(small.seconds, 35, 6, 24, 15.0)


def test_fewer_denoising_steps_shorten_the_modelled_step_by_its_dit_forwards_and_raise_the_limit(bench):
    """t(b) is a chunk of 16 steps; at n steps the DiT's share of it (14B 0.93) scales with its DiT forwards (the
    prefill and the steps upstream's fixed mask runs, carried over to n: 1 + 8, 1 + 6, 1 + 4). 14B at 15 Hz: 8 steps
    t(1) = 0.484 s, d = 8, 8 + 7.26 N <= 24 -> 2 robots; 4 steps t(1) = 0.358 s, d = 6, 6 + 5.37 N <= 24 -> 3."""
    from ardiff_server.engine.modelled_step import dit_forwards, step_time_profile

    big, small = step_time_profile("14b"), step_time_profile("5b")
    assert [dit_forwards(n) for n in (16, 8, 4, 1)] == [9, 7, 5, 2]
    assert big.seconds(1, 16) == big.seconds(1) == pytest.approx(0.61)
    assert [big.seconds(1, n) for n in (8, 4)] == pytest.approx([0.61 * (0.07 + 0.93 * 7 / 9), 0.61 * (0.07 + 0.93 * 5 / 9)])
    assert big.seconds(3, 4) == pytest.approx(3 * big.seconds(1, 4))  # still compute-bound: b t(1)
    assert small.seconds(1, 4) == pytest.approx(0.15 * (0.72 + 0.28 * 5 / 9))  # the 5B's chunk is mostly not its DiT
    assert [bench.fleet_limit(big.at_steps(n), hz=15.0, max_batch=3) for n in (16, 8, 4)] == [1, 2, 3]
    assert bench.fleet_limit(small.at_steps(4), hz=15.0, max_batch=4) == 32  # 28 at 16 steps
    assert "x 0.587 (4 steps)" in bench.limit_formula(big, 15.0, 3, 4)


def test_a_time_scaled_run_is_the_same_schedule_slower(bench):
    """--time-scale k: t(b) x k at f / k Hz leaves every limit as it is (ceil(f t) and f t are unchanged), so a CPU whose
    own step overruns the 5B's 0.15 s can run its schedule 3x slower."""
    from ardiff_server.engine.modelled_step import step_time_profile

    for name in ("14b", "5b"):
        profile = step_time_profile(name)
        slow = bench.scaled(profile, 3.0)
        assert slow.seconds(2, 4) == pytest.approx(3.0 * profile.seconds(2, 4))
        for steps in (16, 8, 4):
            for max_batch in (1, 4):
                fast_limit = bench.fleet_limit(profile.at_steps(steps), hz=15.0, max_batch=max_batch)
                assert bench.fleet_limit(slow.at_steps(steps), hz=5.0, max_batch=max_batch) == fast_limit, (name, steps, max_batch)
    assert bench.scaled(step_time_profile("14b"), 1.0) is step_time_profile("14b")


def test_capacity_counts_up_from_one_robot_and_stops_at_the_first_that_idles_or_jerks(bench):
    row = lambda n, idle, seam: bench.Row("14b", "arrival", "half", n, steady_idle_per_chunk=idle, seam_ratio=seam)  # noqa: E731
    rows = [row(1, 0.0, 1.5), row(2, 0.0, 1.9), row(3, 0.4, 1.5), row(4, 0.0, 1.5)]
    assert bench.capacity(rows, "14b", "arrival", "half") == 2
    assert bench.capacity([row(1, 0.0, 2.5)], "14b", "arrival", "half") == 0
    assert bench.capacity(rows, "14b", "deadline", "half") is None  # not run
    assert bench.capacity(rows, "14b", "arrival", "half", denoise=4) is None  # not run at 4 steps
    fewer = [bench.Row("14b", "arrival", "half", n, denoise=4, steady_idle_per_chunk=0.0, seam_ratio=1.0) for n in (1, 2, 3)]
    assert bench.capacity(rows + fewer, "14b", "arrival", "half", denoise=4) == 3
    assert bench.capacity(rows + fewer, "14b", "arrival", "half") == 2  # each step count its own capacity
    assert bench.capacity_line(rows, 1) == "capacity: arrival=2 deadline=n/a limit=1"


def test_the_smallest_bench_prints_its_table_and_a_capacity_line(bench, capsys):
    bench.main(
        [
            "--profiles",
            "14b",
            "--robots",
            "1",
            "--no-cpu",
            "--schedules",
            "arrival",
            "--asking",
            "half",
            "--steps",
            "90",
            "--checkpoint",
            "builtin:tiny",
        ]
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| profile | denoise steps |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == list(bench.COLUMNS)
    # the columns, then what says whether a row is the profile's schedule (overruns, the real step, the load)
    assert columns[:5] == ["profile", "denoise steps", "scheduler", "asking", "robots"] and len(columns) == 18
    assert columns[5:9] == ["steady idle / robot / chunk", "deadline misses", "seam / inner", "chunks/s per robot"]
    assert columns[12:] == ["overrun", "real step p50 (ms)", "encode p50 (ms)", "robots' cores", "server's cores", "others' cores"]
    row = next(line for line in lines if line.startswith("| 14b | 16 | arrival | half | 1 |"))
    cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
    # numbers, or "-" where a loaded CPU left too few chunks to say (a robot with one chunk has no steady state)
    assert all(re.fullmatch(r"-|\d+(\.\d+)?", cells[c]) for c in columns[5:12] + columns[13:]), row
    assert float(cells["mean batch"]) == 1.0  # one robot: every step a batch of one
    assert cells["latency p50 (ms)"] == "-" or float(cells["latency p50 (ms)"]) >= 610.0  # every step lasts the 14B's t(1) at least
    assert re.fullmatch(r"\d+%", cells["overrun"]), row  # the share of steps that overran the modelled time
    assert float(cells["real step p50 (ms)"]) > 0 and float(cells["server's cores"]) > 0  # the tiny model's own step, its CPU
    assert float(cells["encode p50 (ms)"]) > 0  # the session's first call encodes its prompt on the encoder thread
    assert "limit 14b at 16 steps = 1: largest N served in some k >= N/1 batches a round" in out
    assert "limit 14b at 4 steps = 3:" in out and "| 14b | 4 | deadline | adaptive | n/a | 3 |" in out  # not run here
    assert re.fullmatch(r"capacity: arrival=(\d+|n/a) deadline=(\d+|n/a) limit=1", lines[-1]), lines[-1]
