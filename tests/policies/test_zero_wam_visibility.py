"""Upstream Zero-WAM's cache rules, confirmed on their metadata (tests/helpers/zero_wam_cache.py): what the paged
implementation must reproduce (docs/zero-wam.md "The cache")."""

from __future__ import annotations

from tests.helpers.zero_wam_cache import ACTION, ICL, OBSERVATION, PREDICTION, VIDEO, Episode


def _run(window: int, chunks: int, cfg: bool = True) -> Episode:
    episode = Episode(window=window, cfg=cfg)
    episode.reset(demonstration=True)
    for _ in range(chunks):
        episode.infer()
        episode.compute_kv_cache()
    episode.infer()  # chunk `chunks` is being predicted
    return episode


def test_only_the_conditional_halfs_video_queries_see_the_demonstration():
    episode = _run(window=64, chunks=3)
    assert any(e.cache_type == ICL for e in episode.visible(VIDEO, 0))
    assert not any(e.cache_type == ICL for e in episode.visible(ACTION, 0))
    assert not any(e.cache_type == ICL for e in episode.visible(VIDEO, 1))


def test_the_demonstration_outlives_the_window():
    episode = _run(window=4, chunks=40)
    assert [e.chunk for e in episode.entries if e.cache_type == ICL] == [-1]
    assert any(e.cache_type == ICL for e in episode.visible(VIDEO, 0))


def test_the_window_keeps_w_over_two_chunks_and_action_queries_miss_the_oldest_video():
    w, chunks = 64, 40
    episode = _run(window=w, chunks=chunks)
    kept = sorted({e.chunk for e in episode.entries if e.cache_type == OBSERVATION})
    assert kept == list(range(chunks - w // 2, chunks))  # 32 chunks: c-31 .. c
    video_q = {(e.kind, e.chunk) for e in episode.visible(VIDEO, 0) if e.cache_type == OBSERVATION}
    action_q = {(e.kind, e.chunk) for e in episode.visible(ACTION, 0) if e.cache_type == OBSERVATION}
    oldest = chunks - w // 2
    assert video_q - action_q == {(VIDEO, oldest)}  # the action queries' window starts one video group later
    assert (ACTION, oldest) in action_q and action_q <= video_q


def test_the_action_history_and_the_prediction_by_half():
    episode = _run(window=64, chunks=2)
    assert {e.seq for e in episode.entries if e.kind == ACTION} == {0}  # the unconditional half has no actions
    predictions = [e for e in episode.entries if e.cache_type == PREDICTION]
    assert [(e.seq, e.chunk) for e in predictions] == [(0, 2), (1, 2)]  # the chunk being predicted, both halves
    assert all(e.cache_type != PREDICTION for e in _committed(episode).entries)


def _committed(episode: Episode) -> Episode:
    episode.compute_kv_cache()  # the prediction is dropped before the observation is written
    return episode


def test_without_cfg_one_half():
    episode = _run(window=64, chunks=2, cfg=False)
    assert {e.seq for e in episode.entries} == {0}
