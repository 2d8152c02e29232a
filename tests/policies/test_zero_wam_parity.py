"""Zero-WAM's transformer (policies/lingbot_va/zero_wam_model.py) against upstream's own outputs.

``tests/reference_data/upstream_zero_wam_tiny.*`` holds what upstream's ``WanICLTransformer3DModel`` computed on the
tiny checkpoint (scripts/record_upstream_zero_wam.py): one forward of each stream without a cache (the video packed for
text guidance by the server's own ``_pack_icl_cfg``), and every forward of an episode through upstream's cache (the
demonstration pinned, in-context guidance, a window of two chunks that slides, a chunk predicted twice). Float32 with
upstream's bf16 cast of q/k/v neutralised: max abs error <= 1e-5; bf16 as upstream deploys it: the bf16 bound below.

Each guided video forward is one batch of two rows here (the halves upstream packs along the sequence axis), each row
over the K/V its half may see (tests/helpers/zero_wam.py), so the engine's branch batching is what is checked.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_policies.lingbot_va.model import video_grid
from ardiff_policies.lingbot_va.zero_wam_model import expert_action_grid, load_zero_wam_transformer
from ardiff_policies.lingbot_va.zero_wam_tiny import ensure_tiny_zero_wam_checkpoint
from ardiff_policies.wan.tiny import tree_digest
from tests.helpers.lingbot_va import randn, sha, text_embeddings
from tests.helpers.scripts import load_script
from tests.helpers.zero_wam import ATOL, UpstreamCache, reference_or_skip
from tests.helpers.zero_wam_cache import ACTION, ICL, OBSERVATION, PREDICTION, VIDEO, Entry, sees

# bf16: upstream's model cast with .to(bfloat16) (its RoPE frequency buffers rounded to bf16 too; this transformer's
# angles are not) against this transformer in bf16, both on the CPU. Measured (torch 2.13 CPU): at most 0.031 on outputs
# up to 4.9, one bf16 step at that size; upstream's own bf16 run is 0.042 from its float32 one. The bound: two steps.
BF16_ATOL = 0.0625
CACHE_TYPES = {"prediction": PREDICTION, "observation": OBSERVATION}
RECORD = load_script("record_upstream_zero_wam")  # its demonstrations, drawn as recorded


@pytest.fixture(scope="module")
def reference():
    return reference_or_skip()


@pytest.fixture(scope="module")
def tiny_dir():
    return ensure_tiny_zero_wam_checkpoint()


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_zero_wam_transformer(tiny_dir / "transformer")


def test_the_reference_was_recorded_on_these_weights(reference, tiny_dir):
    meta, _ = reference
    assert meta["checkpoint_transformer_sha256"] == tree_digest(tiny_dir / "transformer"), (
        "the tiny Zero-WAM changed: rerun scripts/record_upstream_zero_wam.py"
    )


def _single(meta, model, stream: str, dtype: torch.dtype) -> torch.Tensor:
    s, base = meta["single"], model.config.base
    text = text_embeddings(meta, base.text_dim)
    assert sha(text) == meta["input_sha256"]["text"]
    f, start = s["frames"], s["frames"] * s["chunk"]
    if stream == "video":  # both halves of text guidance: prompt / negative prompt, the first frame clean
        x = randn((1, base.in_channels, f, s["height"], s["width"]), s["seed"])
        rows, grid, timesteps = 2, video_grid(f, s["height"] // 2, s["width"] // 2, start), [0.0] + [s["t"]] * (f - 1)
    else:  # actions never have guidance: one half, the prompt
        x = randn((1, base.action_dim, f, s["actions_per_frame"], 1), s["seed"] + 1)
        rows, grid, timesteps, text = 1, expert_action_grid(f, s["actions_per_frame"], start), [s["t"]] * f, text[:1]
    assert sha(x) == meta["input_sha256"][f"single.{stream}"]
    with torch.no_grad():
        out = model(
            x.repeat(rows, 1, 1, 1, 1).to(dtype),
            torch.tensor([timesteps] * rows),
            grid[None].repeat(rows, 1, 1),
            text.to(dtype),
            action_mode=stream == "action",
        )
    return out.float()


@pytest.mark.parametrize("stream", ["video", "action"])
def test_one_forward_matches_upstream(reference, model, stream):
    meta, tensors = reference
    out, expected = _single(meta, model, stream, torch.float32), tensors[f"single.{stream}"]
    assert out.shape == expected.shape
    error = (out - expected).abs().max().item()
    assert error <= ATOL, f"{stream}: max abs error {error:.3g} vs upstream"
    if stream == "video":  # the halves differ only by their text: a cross-attention that ignored it would pass on one
        assert (expected[0] - expected[1]).abs().max() > 1e-3


def _episode(meta, model, dtype: torch.dtype = torch.float32, rule=sees) -> dict[int, torch.Tensor]:
    """Every forward of the recorded episode through upstream's cache: {call index: output (halves, ...)}."""
    ep, base = meta["episode"], model.config.base
    text = text_embeddings(meta, base.text_dim)
    prompt = model.project_text(text[:1].to(dtype))
    cache = UpstreamCache(base.num_layers, base.num_attention_heads, base.attention_head_dim, meta["attn_window"], dtype, rule=rule)
    f, h, w, n_actions = ep["frames"], ep["height"], ep["width"], ep["actions_per_frame"]
    outputs = {}
    for n, call in enumerate(ep["calls"]):
        chunk = call["chunk"]
        if call["kind"] == "icl":  # bidirectional over its own tokens, frame id 0, its rows 24 below the robot's
            d = ep["demo"]
            item = RECORD.demonstration(d, base.in_channels, base.text_dim)  # upstream's .pth item: (1, C, F, H, W), (T, D)
            x, own_text = item["latent"], item["text_emb"][None]
            grid = video_grid(d["frames"], d["height"] // 2, d["width"] // 2, 0)
            grid[1] += meta["icl_rope_h"]
            text_kv, rows, kind, frame = model.project_text(own_text.to(dtype)), [0], VIDEO, 0
        elif call["kind"] == "video":
            x = randn((1, base.in_channels, f, h, w), call["seed"])
            grid = video_grid(f, h // 2, w // 2, f * chunk)
            text_kv, rows, kind, frame = [(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in prompt], [0, 1], VIDEO, 2 * chunk
        else:
            x = randn((1, base.action_dim, f, n_actions, 1), call["seed"])
            grid = expert_action_grid(f, n_actions, f * chunk)
            text_kv, rows, kind, frame = prompt, [0], ACTION, 2 * chunk + 1
        assert sha(x) == meta["input_sha256"][f"episode.{n}"]
        if call.get("clear_prediction"):
            cache.clear_prediction_cache(-1)
        self_kv, own = cache.inputs([(kind, seq, frame) for seq in rows], grid.shape[1])
        with torch.no_grad():
            out = model(
                x.repeat(len(rows), 1, 1, 1, 1).to(dtype),
                torch.tensor([call["timesteps"]] * len(rows)),
                grid[None].repeat(len(rows), 1, 1),
                text_kv,
                action_mode=kind == ACTION,
                self_kv=self_kv,
            )
        outputs[n] = out.float()
        if call["update"]:
            cache_type = ICL if call["kind"] == "icl" else CACHE_TYPES[call["cache_type"]]
            cache.keep(own, [Entry(kind, cache_type, seq, frame, chunk if cache_type != ICL else -1) for seq in rows])
        if call.get("clean_window"):
            cache.clear_prediction_cache(meta["attn_window"])
    return outputs


def test_every_forward_through_upstreams_cache_matches(reference, model):
    meta, tensors = reference
    errors = {n: (out - tensors[f"episode.{n}"]).abs().max().item() for n, out in _episode(meta, model).items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ATOL, f"forward {worst} ({meta['episode']['calls'][worst]}): max abs error {errors[worst]:.3g} vs upstream"


def test_the_episode_anchor_has_teeth(reference, model):
    """Action queries that also read the demonstration (what a cache that forgot attend_pinned=False would do) move
    the first action forward far past the tolerance; so does a second prediction of a chunk that forgot the first."""
    meta, tensors = reference
    calls = meta["episode"]["calls"]

    def action_sees_icl(kind, seq, frame, key, window):
        return sees(VIDEO, seq, frame, key, window) if key.cache_type == ICL else sees(kind, seq, frame, key, window)

    first_action = next(n for n, c in enumerate(calls) if c["kind"] == "action")
    out = _episode(meta, model, rule=action_sees_icl)[first_action]
    assert (out - tensors[f"episode.{first_action}"]).abs().max().item() > 100 * ATOL

    def older_predictions_forgotten(kind, seq, frame, key, window):
        return sees(kind, seq, frame, key, window) and not (key.cache_type == PREDICTION and key.frame == frame - (kind == ACTION))

    repeated = [n for n, c in enumerate(calls) if c["kind"] == "video" and c["chunk"] == 1 and c["cache_type"] == "prediction"]
    second = repeated[len(repeated) // 2]  # the second infer's first video step: it reads the first prediction upstream
    out = _episode(meta, model, rule=older_predictions_forgotten)[second]
    assert (out - tensors[f"episode.{second}"]).abs().max().item() > 100 * ATOL


def test_bf16_matches_upstreams_bf16(reference, tiny_dir):
    meta, tensors = reference
    model = load_zero_wam_transformer(tiny_dir / "transformer", dtype=torch.bfloat16)
    errors = {f"single.{s}": (_single(meta, model, s, torch.bfloat16) - tensors[f"bf16.single.{s}"]).abs().max().item() for s in ("video", "action")}
    errors |= {f"episode.{n}": (out - tensors[f"bf16.episode.{n}"]).abs().max().item() for n, out in _episode(meta, model, torch.bfloat16).items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= BF16_ATOL, f"{worst}: max abs error {errors[worst]:.3g} vs upstream's bf16"
    # the bf16 anchor is its own: upstream's bf16 run is not its float32 one
    assert (tensors["bf16.episode.1"] - tensors["episode.1"]).abs().max() > 10 * ATOL
