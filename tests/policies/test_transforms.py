"""DROID transforms pinned with small hand-checkable inputs."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_policies.dreamzero.transforms import (
    NormStats,
    crop_and_resize,
    denormalize_actions,
    droid_prompt,
    normalize_state,
    stitch_views,
    to_absolute_joints,
)


def view(value: int, t: int = 1, h: int = 2, w: int = 3) -> np.ndarray:
    return np.full((t, h, w, 3), value, dtype=np.uint8)


def test_canvas_layout_wrist_on_top_exteriors_below():
    wrist = np.arange(6, dtype=np.uint8).reshape(1, 2, 3, 1).repeat(3, axis=3)  # distinct pixels
    canvas = stitch_views(wrist, view(20), view(30), view_size=(2, 3))
    assert canvas.shape == (1, 4, 6, 3)
    # top row: each wrist pixel repeated twice along the width
    assert canvas[0, 0, :, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert canvas[0, 1, :, 0].tolist() == [3, 3, 4, 4, 5, 5]
    assert (canvas[0, 2:, :3] == 20).all() and (canvas[0, 2:, 3:] == 30).all()


def test_missing_cameras_are_black():
    canvas = stitch_views(None, view(20, t=4), None, view_size=(2, 3))
    assert canvas.shape == (4, 4, 6, 3)
    assert (canvas[:, :2] == 0).all() and (canvas[:, 2:, :3] == 20).all() and (canvas[:, 2:, 3:] == 0).all()
    assert (stitch_views(None, None, None, view_size=(2, 3)) == 0).all()


def test_views_must_agree_on_frame_count():
    with pytest.raises(ValueError, match="differ in length"):
        stitch_views(view(1, t=1), view(2, t=4), None, view_size=(2, 3))


def test_center_crop_keeps_the_middle_95_percent():
    frame = np.zeros((1, 20, 40, 3), dtype=np.uint8)
    frame[0, :, :, 0] = np.arange(40, dtype=np.uint8)  # column index in the red channel
    frame[0, :, :, 1] = np.arange(20, dtype=np.uint8)[:, None]  # row index in green
    out = crop_and_resize(frame, (19, 38))  # crop 19x38 is exactly the target: no resampling
    # rows: (20 - 19) / 2 = 0.5 rounds to 0 (torchvision's rule); columns: (40 - 38) / 2 = 1
    assert out.shape == (1, 19, 38, 3)
    assert out[0, 0, :, 0].tolist() == list(range(1, 39))
    assert out[0, :, 0, 1].tolist() == list(range(0, 19))


def test_resize_preserves_flat_colors_and_any_input_size():
    for h, w in [(180, 320), (288, 512), (7, 9)]:
        out = crop_and_resize(np.full((2, h, w, 3), 200, dtype=np.uint8), (48, 80))
        assert out.shape == (2, 48, 80, 3)
        assert np.abs(out.astype(int) - 200).max() <= 1  # float round trip truncates


def test_prompt_template():
    prompt = droid_prompt("Put the Cup in the SINK.")
    assert prompt.startswith("A multi-view video shows that a robot put the cup in the sink. The video is split into three views:")
    assert prompt.endswith("may be a black screen (dropped view). The robot put the cup in the sink.")
    # upstream's server sends "" for a missing prompt: an empty task (tests/test_prompts.py has every case)
    assert droid_prompt("   ") == droid_prompt("") == droid_prompt(None) and "default behavior" not in droid_prompt("")


STATS = NormStats(q01=np.array([-1.0, 0.0, 2.0]), q99=np.array([1.0, 4.0, 2.0]))


def test_state_normalization_by_hand():
    out = normalize_state(np.array([0.5, 1.0, 7.0]), STATS, max_state_dim=5)
    # (x - q01) / (q99 - q01) * 2 - 1; the constant third dim is not rescaled, only clamped; padded to 5
    assert out.tolist() == [0.5, -0.5, 1.0, 0.0, 0.0]
    assert normalize_state(np.array([9.0, -9.0, 0.0]), STATS, 3).tolist()[:2] == [1.0, -1.0]  # clamped


def test_q99_round_trip():
    x = np.array([[-0.3, 3.9, 2.0], [0.99, 0.01, 2.0]])
    normalized = np.stack([normalize_state(row, STATS, 3) for row in x])
    back = denormalize_actions(normalized, STATS)
    np.testing.assert_allclose(back[:, :2], x[:, :2], atol=1e-12)
    assert denormalize_actions(np.array([[1.0, -1.0, 0.0, 0.5]]), STATS).tolist() == [[1.0, 0.0, 2.0]]  # extra dims dropped


def test_joints_are_relative_gripper_is_absolute():
    actions = np.zeros((2, 8))
    actions[:, 7] = 0.7
    joints = np.arange(8, dtype=np.float64)
    out = to_absolute_joints(actions, joints, relative_dims=7)
    assert out[:, :7].tolist() == [list(range(7))] * 2 and out[:, 7].tolist() == [0.7, 0.7]


def test_stats_come_from_metadata_joint_then_gripper():
    meta = {"oxe_droid": {"statistics": {"action": {"joint_position": {"q01": [1, 2], "q99": [3, 4]}, "gripper_position": {"q01": [0], "q99": [1]}}}}}
    stats = NormStats.from_metadata(meta, "oxe_droid", "action")
    assert stats.q01.tolist() == [1, 2, 0] and stats.q99.tolist() == [3, 4, 1]
    with pytest.raises(ValueError, match=r"oxe_droid\.statistics\.state"):
        NormStats.from_metadata(meta, "oxe_droid", "state")


@pytest.mark.parametrize(
    ("source", "target"),
    [((180, 320), (160, 320)), ((720, 1280), (160, 320)), ((320, 640), (160, 320)), ((90, 160), (160, 320)), ((37, 53), (19, 71)), ((5, 3), (41, 2))],
)
def test_resize_like_opencv_is_bit_exact_to_cv2_inter_linear(source, target):
    """Upstream's 5B server resizes received frames with cv2.resize(INTER_LINEAR); ours must give the same bytes
    (downscale, an exact 2x (OpenCV's area fast path), upscale, odd sizes, saturated pixels)."""
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless (the dev extra) is the independent reference")
    from ardiff_policies.dreamzero.transforms import resize_like_opencv

    rng = np.random.default_rng(sum(source) + sum(target))
    frames = rng.integers(0, 256, (3, *source, 3), dtype=np.uint8)
    frames[1] = 255
    frames[2] = rng.integers(250, 256, (*source, 3), dtype=np.uint8)
    expected = np.stack([cv2.resize(f, (target[1], target[0]), interpolation=cv2.INTER_LINEAR) for f in frames])
    np.testing.assert_array_equal(resize_like_opencv(frames, target), expected)


def test_resize_like_opencv_keeps_frames_already_at_the_size():
    from ardiff_policies.dreamzero.transforms import resize_like_opencv

    frames = np.random.default_rng(0).integers(0, 256, (2, 16, 24, 3), dtype=np.uint8)
    assert resize_like_opencv(frames, (16, 24)) is frames
