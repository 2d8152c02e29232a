"""DreamZero's frozen encoders: checkpoint key maps and numeric behaviour (CPU, fp32, tiny configs)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from torch import Tensor

from ardiff_policies.dreamzero.encoders import CLIP_MEAN, CLIP_STD, ImageEncoder
from ardiff_policies.dreamzero.naming import (
    IMAGE_ENCODER_PREFIX,
    TEXT_ENCODER_PREFIX,
    VAE_PREFIX,
    Target,
    convert_state_dict,
    image_encoder_targets,
    text_encoder_targets,
    vae_targets,
)
from ardiff_policies.dreamzero.upstream_layout import image_encoder_layout, text_encoder_layout, vae_layout
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.vae import WAN21_VAE_CONFIG, VideoVAE
from tests.helpers.reference import REFERENCE_DIR

REFERENCE_TENSORS = REFERENCE_DIR / "dreamzero_droid_tensors.json"

TINY_TEXT = {"vocab_size": 50, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2, "num_heads": 4}
TINY_IMAGE = {
    "hidden_size": 32,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "projection_dim": 24,
}
TINY_VAE = {"base_dim": 8}


# ---------------------------------------------------------------------------------------------
# The released checkpoint's key set, on the meta device
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _reference_tensors() -> dict[str, list]:
    return json.loads(REFERENCE_TENSORS.read_text())["tensors"]


def _build_text() -> tuple[TextEncoder, Callable[[str], list[Target]]]:
    return TextEncoder.from_config(), text_encoder_targets


def _build_image() -> tuple[ImageEncoder, Callable[[str], list[Target]]]:
    return ImageEncoder.from_config(), image_encoder_targets


def _build_vae() -> tuple[VideoVAE, Callable[[str], list[Target]]]:
    vae = VideoVAE.from_config()
    return vae, functools.partial(vae_targets, vae_config=vae.model.config)


@pytest.mark.skipif(not REFERENCE_TENSORS.exists(), reason=f"checkpoint tensor list not found at {REFERENCE_TENSORS}")
@pytest.mark.parametrize(
    ("prefix", "build", "expected_count"),
    [(TEXT_ENCODER_PREFIX, _build_text, 242), (IMAGE_ENCODER_PREFIX, _build_image, 393), (VAE_PREFIX, _build_vae, 194)],
    ids=["text_encoder", "image_encoder", "vae"],
)
def test_checkpoint_keys_map_onto_real_modules(prefix: str, build: Callable, expected_count: int) -> None:
    with torch.device("meta"):
        module, targets_of = build()
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    checkpoint = {k[len(prefix) :]: shape for k, (shape, _) in _reference_tensors().items() if k.startswith(prefix)}
    assert len(checkpoint) == expected_count

    produced: dict[str, tuple[int, ...]] = {}
    for key, shape in checkpoint.items():
        targets = targets_of(key)
        assert targets, f"{key} maps nowhere"
        for target in targets:
            assert target.name not in produced, f"{target.name} produced twice (again by {key})"
            produced[target.name] = tuple(target.transform(torch.empty(shape, device="meta")).shape)

    assert sorted(set(expected) - set(produced)) == [], "module tensors with no checkpoint source"
    assert sorted(set(produced) - set(expected)) == [], "mapped names the module does not have"
    mismatched = {name: (produced[name], expected[name]) for name in expected if produced[name] != expected[name]}
    assert mismatched == {}


def test_default_configs_match_upstream_geometry() -> None:
    with torch.device("meta"):
        text, image, vae = TextEncoder.from_config(), ImageEncoder.from_config(), VideoVAE.from_config()
    t5 = text.model.config
    assert (t5.d_model, t5.num_layers, t5.num_heads, t5.d_kv, t5.d_ff, t5.vocab_size) == (
        4096,
        24,
        64,
        64,
        10240,
        256384,
    )
    assert (t5.relative_attention_num_buckets, t5.relative_attention_max_distance, t5.layer_norm_epsilon) == (
        32,
        128,
        1e-6,
    )
    # Upstream's T5 GELU is the tanh approximation; open-CLIP's ViT uses exact (erf) GELU.
    assert t5.is_gated_act and t5.dense_act_fn == "gelu_new"
    clip = image.model.config
    assert (clip.hidden_size, clip.num_hidden_layers, clip.num_attention_heads, clip.intermediate_size) == (
        1280,
        32,
        16,
        5120,
    )
    assert (clip.patch_size, clip.image_size, clip.projection_dim, clip.hidden_act, clip.layer_norm_eps) == (
        14,
        224,
        1024,
        "gelu",
        1e-5,
    )
    assert (image.num_tokens, image.num_used_layers) == (257, 31)
    assert (vae.latent_channels, vae.temporal_compression, vae.spatial_compression) == (16, 4, 8)


# ---------------------------------------------------------------------------------------------
# Numeric behaviour (tiny configs)
# ---------------------------------------------------------------------------------------------


def test_text_encoder_zeroes_positions_past_each_length() -> None:
    torch.manual_seed(0)
    encoder = TextEncoder.from_config(TINY_TEXT)
    seq_len, lengths = 12, torch.tensor([12, 7, 1])
    attention_mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    input_ids = torch.randint(1, TINY_TEXT["vocab_size"], (3, seq_len)) * attention_mask

    with torch.no_grad():
        out = encoder(input_ids, attention_mask)
        raw = encoder.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    assert out.shape == (3, seq_len, TINY_TEXT["d_model"]) and out.dtype == torch.float32
    for row, length in enumerate(lengths.tolist()):
        assert torch.equal(out[row, length:], torch.zeros_like(out[row, length:]))
        assert torch.equal(out[row, :length], raw[row, :length])
        assert out[row, :length].abs().sum(dim=-1).gt(0).all()


def _clip_preprocess(images: Tensor, size: int) -> Tensor:
    pixels = F.interpolate(images, size=(size, size), mode="bicubic", align_corners=False) * 0.5 + 0.5
    return (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)


def test_image_encoder_returns_penultimate_block_tokens() -> None:
    torch.manual_seed(0)
    encoder = ImageEncoder.from_config(TINY_IMAGE)
    last_layer_ran = []
    encoder.model.vision_model.encoder.layers[-1].register_forward_hook(lambda *_: last_layer_ran.append(True))
    images = torch.rand(2, 3, 176, 320) * 2 - 1

    with torch.no_grad():
        out = encoder(images)
    assert out.shape == (2, 257, TINY_IMAGE["hidden_size"])
    assert not last_layer_ran, "the last block must not run"

    # Independent path: the library's own forward; hidden_states[k] is the output of k blocks.
    with torch.no_grad():
        reference = encoder.model.vision_model(pixel_values=_clip_preprocess(images, 224), output_hidden_states=True).hidden_states[
            TINY_IMAGE["num_hidden_layers"] - 1
        ]
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


def test_vae_encode_returns_normalized_posterior_mean() -> None:
    torch.manual_seed(0)
    vae = VideoVAE.from_config(TINY_VAE)
    video = torch.rand(1, 3, 5, 16, 24) * 2 - 1

    with torch.no_grad():
        latents = vae.encode(video)
        mean = vae.model.encode(video).latent_dist.mean
    assert latents.shape == (1, 16, 2, 2, 3)
    stats_shape = (1, 16, 1, 1, 1)
    expected = (mean - torch.tensor(WAN21_VAE_CONFIG["latents_mean"]).view(stats_shape)) / torch.tensor(WAN21_VAE_CONFIG["latents_std"]).view(
        stats_shape
    )
    torch.testing.assert_close(latents, expected, rtol=1e-6, atol=1e-6)


def test_vae_decode_never_waits_for_an_encode_nor_disturbs_one() -> None:
    """The recording decodes on its own thread while the batch and the encoder thread encode. diffusers keeps the
    causal cache on the module (``clear_cache`` resets the decoder's too), so encodes hold the VAE's lock; a decode
    carries a cache of its own: it runs while an encode is in progress, and both give what each gives alone.
    Before: a decode waited for the encode's lock (and, without it, an encode's clear_cache broke the decode)."""
    import threading

    torch.manual_seed(0)
    vae = VideoVAE.from_config(TINY_VAE).eval()
    video = torch.rand(1, 3, 5, 16, 24) * 2 - 1
    latents = torch.randn(1, 16, 3, 2, 3)

    def in_thread(results: dict, key: str, fn: Callable[[], Tensor]) -> threading.Thread:
        def run() -> None:
            with torch.no_grad():  # grad mode is per thread
                results[key] = fn()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with torch.no_grad():
        alone_encode, alone_decode = vae.encode(video), vae.decode(latents)
    inside, release = threading.Event(), threading.Event()
    real_encode = vae.model.encode

    def slow_encode(x):
        out = real_encode(x)
        inside.set()
        assert release.wait(30)  # still holding the lock, the module's cache in use
        return out

    vae.model.encode = slow_encode
    results: dict[str, Tensor] = {}
    encoder = in_thread(results, "z", lambda: vae.encode(video))
    assert inside.wait(30)
    decoder = in_thread(results, "video", lambda: vae.decode(latents))
    decoder.join(10)
    done_while_encoding = not decoder.is_alive()
    release.set()
    encoder.join(30)
    decoder.join(30)
    assert done_while_encoding, "the decode waited for the encode"
    assert torch.equal(results["video"], alone_decode) and torch.equal(results["z"], alone_encode)
    vae.model.encode = real_encode
    for _ in range(3):  # interleaved for real: each still equal to its lone result
        results = {}
        threads = [in_thread(results, "z", lambda: vae.encode(video)), in_thread(results, "video", lambda: vae.decode(latents))]
        for thread in threads:
            thread.join(60)
        assert torch.equal(results["video"], alone_decode) and torch.equal(results["z"], alone_encode)
    assert set(vae.state_dict()) == set(VideoVAE.from_config(TINY_VAE).state_dict())  # no second copy of the weights


def test_vae_encode_rejects_frame_counts_it_would_truncate() -> None:
    vae = VideoVAE.from_config(TINY_VAE)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        vae.encode(torch.zeros(1, 3, 4, 16, 16))


# ---------------------------------------------------------------------------------------------
# Round trip: upstream-named tensors -> key maps -> load_state_dict(strict=True)
# ---------------------------------------------------------------------------------------------


def _random(shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def _load(module: torch.nn.Module, source: dict[str, Tensor], targets_of: Callable[[str], list[Target]]) -> dict[str, Tensor]:
    converted = convert_state_dict(source, targets_of)
    module.load_state_dict(converted, strict=True)
    loaded = module.state_dict()
    for key, tensor in source.items():
        for target in targets_of(key):
            assert torch.equal(loaded[target.name], target.transform(tensor)), target.name
    return loaded


def test_text_encoder_round_trip() -> None:
    torch.manual_seed(0)
    encoder = TextEncoder.from_config(TINY_TEXT)
    source = _random(text_encoder_layout(TINY_TEXT))
    loaded = _load(encoder, source, text_encoder_targets)

    assert encoder.model.shared.weight is encoder.model.encoder.embed_tokens.weight, "embedding tie broken"
    assert torch.equal(loaded["model.shared.weight"], source["token_embedding.weight"])
    ffn = "model.encoder.block.1.layer.1.DenseReluDense"
    assert torch.equal(loaded[f"{ffn}.wi_0.weight"], source["blocks.1.ffn.gate.0.weight"])  # GELU branch
    assert torch.equal(loaded[f"{ffn}.wi_1.weight"], source["blocks.1.ffn.fc1.weight"])  # linear branch
    assert torch.equal(
        loaded["model.encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"],
        source["blocks.1.pos_embedding.embedding.weight"],
    )


def test_image_encoder_round_trip() -> None:
    torch.manual_seed(0)
    encoder = ImageEncoder.from_config(TINY_IMAGE)
    dim = TINY_IMAGE["hidden_size"]
    source = _random(image_encoder_layout(TINY_IMAGE))
    loaded = _load(encoder, source, image_encoder_targets)

    layer = "model.vision_model.encoder.layers.2.self_attn"
    qkv_weight, qkv_bias = (
        source["visual.transformer.2.attn.to_qkv.weight"],
        source["visual.transformer.2.attn.to_qkv.bias"],
    )
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        assert torch.equal(loaded[f"{layer}.{proj}.weight"], qkv_weight[i * dim : (i + 1) * dim])
        assert torch.equal(loaded[f"{layer}.{proj}.bias"], qkv_bias[i * dim : (i + 1) * dim])
    assert torch.equal(loaded["model.visual_projection.weight"], source["visual.head"].T)
    assert torch.equal(loaded["model.vision_model.embeddings.class_embedding"], source["visual.cls_embedding"].flatten())
    assert torch.equal(loaded["model.vision_model.embeddings.position_embedding.weight"], source["visual.pos_embedding"][0])
    assert torch.equal(loaded["logit_scale"], source["log_scale"])


def test_vae_round_trip_with_non_default_structure() -> None:
    # Three levels and one resnet per level: the block grouping must follow the config, not the real model.
    config = {"base_dim": 4, "dim_mult": [1, 2, 2], "num_res_blocks": 1, "temperal_downsample": [False, True]}
    torch.manual_seed(0)
    vae = VideoVAE.from_config(config)
    source = _random(vae_layout(config))
    loaded = _load(vae, source, functools.partial(vae_targets, vae_config=vae.model.config))

    # Decoder flat list: [res, res, up3d] [res, res, up2d] [res, res] (temporal flags reversed);
    # level 1's first resnet widens d -> 2d, so it has the shortcut.
    expected = {
        "decoder.upsamples.2.time_conv.weight": "model.decoder.up_blocks.0.upsamplers.0.time_conv.weight",
        "decoder.upsamples.3.shortcut.weight": "model.decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
        "decoder.upsamples.5.resample.1.weight": "model.decoder.up_blocks.1.upsamplers.0.resample.1.weight",
        "decoder.upsamples.7.residual.6.weight": "model.decoder.up_blocks.2.resnets.1.conv2.weight",
        "encoder.downsamples.3.time_conv.weight": "model.encoder.down_blocks.3.time_conv.weight",
        "encoder.middle.1.to_qkv.weight": "model.encoder.mid_block.attentions.0.to_qkv.weight",
        "encoder.middle.2.residual.0.gamma": "model.encoder.mid_block.resnets.1.norm1.gamma",
        "conv1.weight": "model.quant_conv.weight",
        "conv2.bias": "model.post_quant_conv.bias",
    }
    for upstream, ours in expected.items():
        assert torch.equal(loaded[ours], source[upstream]), upstream
    assert (vae.temporal_compression, vae.spatial_compression) == (2, 4)


@pytest.mark.parametrize(
    ("targets_of", "key"),
    [
        (text_encoder_targets, "blocks.0.attn.qkv.weight"),
        (text_encoder_targets, "pos_embedding.embedding.weight"),  # shared_pos=True layout
        (image_encoder_targets, "textual.token_embedding.weight"),
        (image_encoder_targets, "visual.transformer.0.attn.to_q.weight"),
        (functools.partial(vae_targets, vae_config=WAN21_VAE_CONFIG), "decoder.downsamples.0.residual.0.gamma"),
        (functools.partial(vae_targets, vae_config=WAN21_VAE_CONFIG), "encoder.downsamples.2.residual.0.gamma"),
        (functools.partial(vae_targets, vae_config=WAN21_VAE_CONFIG), "encoder.downsamples.11.residual.0.gamma"),
        (functools.partial(vae_targets, vae_config=WAN21_VAE_CONFIG), "decoder.upsamples.3.residual.0.gamma"),
        (functools.partial(vae_targets, vae_config=WAN21_VAE_CONFIG), "model.conv1.weight"),
    ],
)
def test_unknown_keys_raise_key_error_naming_the_key(targets_of: Callable[[str], list[Target]], key: str) -> None:
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        targets_of(key)


def test_vae_map_rejects_layouts_diffusers_cannot_hold() -> None:
    with pytest.raises(ValueError, match="attn_scales"):
        vae_targets("conv1.weight", {**WAN21_VAE_CONFIG, "attn_scales": [0.5]})
    with pytest.raises(ValueError, match=r"Wan2\.1"):
        VideoVAE(AutoencoderKLWan(base_dim=8, z_dim=16, is_residual=True))
