"""Zero-WAM's demonstrations (ardiff_policies.lingbot_va.zero_wam_demonstration): upstream's four latent layouts read
the same, and every missing, malformed or too large demonstration is one line naming the id."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from ardiff_policies.lingbot_va.episode import EpisodeError
from ardiff_policies.lingbot_va.zero_wam_demonstration import DemonstrationError, DemonstrationStore

C, F, H, W, TEXT_DIM = 48, 3, 4, 6, 32


@pytest.fixture()
def store(tmp_path) -> DemonstrationStore:
    return DemonstrationStore(tmp_path, latent_channels=C, text_dim=TEXT_DIM, max_tokens=F * (H // 2) * (W // 2), max_file_bytes=1 << 20)


def _latent() -> torch.Tensor:
    return torch.randn(1, C, F, H, W, generator=torch.Generator().manual_seed(0))


def _save(root: Path, demo_id: str, item) -> None:
    path = root / f"{demo_id}.pth"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(item, path)


def _layouts(latent: torch.Tensor) -> dict[str, dict]:
    fhwc = latent[0].permute(1, 2, 3, 0).contiguous()
    return {
        "bcfhw": {"latent": latent},
        "cfhw": {"latent": latent[0]},
        "fhwc": {"latent": fhwc, "latent_layout": "f_h_w_c"},
        "flat": {"latent": fhwc.reshape(F * H * W, C), "latent_num_frames": F, "latent_height": H, "latent_width": W},
    }


@pytest.mark.parametrize("layout", ["bcfhw", "cfhw", "fhwc", "flat"])
def test_upstreams_layouts_read_the_same(store, tmp_path, layout):
    latent = _latent()
    _save(tmp_path, f"task/demo.v1_{layout}", _layouts(latent)[layout])
    demo = store.load(f"task/demo.v1_{layout}")  # a dot in the name stays (ids omit the extension)
    torch.testing.assert_close(demo.latent, latent, rtol=0, atol=0)
    assert demo.text_embedding is None and demo.tokens() == F * (H // 2) * (W // 2)


def test_its_own_text_is_read_two_or_three_dimensional(store, tmp_path):
    text = torch.randn(7, TEXT_DIM)
    _save(tmp_path, "a", {"latent": _latent(), "text_emb": text})
    _save(tmp_path, "b", {"latent": _latent(), "text_emb": text[None]})
    for demo_id in ("a", "b"):
        torch.testing.assert_close(store.load(demo_id).text_embedding, text[None], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("demo_id", "message"),
    [
        ("../escape", "must be relative, without '..'"),
        ("/abs/path", "must be relative"),
        ("", "expected a non-empty relative POSIX path"),
        (7, "expected a non-empty relative POSIX path, got 7"),
        ("nothing/here", "no here.pth under the demonstration root"),
    ],
)
def test_a_bad_or_missing_id_is_named(store, demo_id, message):
    with pytest.raises(DemonstrationError, match=re.escape(message)):
        store.load(demo_id)


def test_a_video_only_demonstration_is_refused_saying_why(store, tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 16)
    with pytest.raises(DemonstrationError, match=re.escape("only clip.mp4 exists; this server reads pre-encoded latents")):
        store.load("clip")


def _bad(latent: torch.Tensor) -> dict[str, tuple[object, str]]:
    nan = latent.clone()
    nan[0, 0, 0, 0, 0] = float("nan")
    return {
        "not a dict": ([latent], "expected a dict with 'latent'"),
        "channels": ({"latent": latent[:, :8]}, "latent has 8 channels; the VAE has 48"),
        "odd": ({"latent": latent[..., :5]}, "height and width must be even"),
        "batch": ({"latent": latent.repeat(2, 1, 1, 1, 1)}, "latent batch must be 1"),
        "ints": ({"latent": latent.long()}, "latent must be a floating-point tensor"),
        "flat without sizes": ({"latent": latent.reshape(-1, C)}, "needs integer latent_num_frames"),
        "flat mismatch": (
            {"latent": latent[0].permute(1, 2, 3, 0).reshape(-1, C), "latent_num_frames": 2, "latent_height": H, "latent_width": W},
            "does not match 2x4x6",
        ),
        "3-d": ({"latent": latent[0, 0]}, "is none of"),
        "nan": ({"latent": nan}, "latent contains NaN or infinity"),
        "text dim": ({"latent": latent, "text_emb": torch.randn(5, 8)}, "text_emb (1, 5, 8): expected (T, 32)"),
        "too long": ({"latent": torch.cat([latent, latent], dim=2)}, "36 tokens (6 latent frames of 4x6), more than the 18 a session may pin"),
    }


@pytest.mark.parametrize("case", list(_bad(torch.zeros(1, C, F, H, W))))
def test_a_malformed_or_too_large_demonstration_is_one_line(store, tmp_path, case):
    item, message = _bad(_latent())[case]
    _save(tmp_path, "d", item)
    with pytest.raises(DemonstrationError, match=re.escape(message)) as info:
        store.load("d")
    assert "\n" not in str(info.value) and "icl_demo_id 'd'" in str(info.value)
    assert isinstance(info.value, EpisodeError)  # answered as a bad request, the session unchanged


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path):
    store = DemonstrationStore(tmp_path, latent_channels=C, text_dim=TEXT_DIM, max_tokens=10**6, max_file_bytes=1000)
    _save(tmp_path, "big", {"latent": _latent()})
    with pytest.raises(DemonstrationError, match=r"big\.pth is \d+ bytes, more than 1000"):
        store.load("big")


class _Gadget:  # pickled objects other than tensors and containers are never unpickled
    def __reduce__(self):
        return (print, ("unpickled",))


def test_arbitrary_pickles_and_corrupt_files_are_refused(store, tmp_path):
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"latent": _Gadget()}, f, protocol=2)
    with pytest.raises(DemonstrationError, match=re.escape("icl_demo_id 'evil': cannot read evil.pth")):
        store.load("evil")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(DemonstrationError, match=re.escape("cannot read junk.pth")):
        store.load("junk")
