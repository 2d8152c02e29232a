"""bf16 rounding placed where upstream DreamZero places it (dreamzero0/dreamzero), module by module.

Each reference below spells out upstream's sequence of roundings op by op; the modules must match it bit for bit
in bf16, the previous placement must not (so each test can fail), and float32 results must not change.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from ardiff_policies.dreamzero.dit import MultiEmbodimentActionEncoder
from ardiff_policies.dreamzero.transforms import pixels_to_model_range
from ardiff_policies.wan.text import TextEncoder
from ardiff_policies.wan.vae import UpstreamRMSNorm, VideoVAE

BF16 = torch.bfloat16


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ pixels


def upstream_pixels(pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """WANPolicyHead.lazy_joint_video_action: float() / 255, .to(model dtype), torchvision Normalize(0.5, 0.5),
    whose mean/std tensors take the input's dtype and which subtracts, then divides."""
    x = (pixels.float() / 255.0).to(dtype)
    mean = torch.tensor([0.5, 0.5, 0.5], dtype=x.dtype).view(1, 3, 1, 1, 1)
    std = torch.tensor([0.5, 0.5, 0.5], dtype=x.dtype).view(1, 3, 1, 1, 1)
    return x.sub(mean).div(std)


def test_pixels_round_to_bf16_before_the_normalization():
    pixels = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 1, 256).expand(1, 3, 2, 1, 256)  # every value
    ours = pixels_to_model_range(pixels, BF16)
    assert ours.dtype == BF16 and torch.equal(ours, upstream_pixels(pixels, BF16))
    old = (pixels.float() / 255.0 * 2.0 - 1.0).to(BF16)  # normalized in float32, rounded once
    assert _differs(ours, old)
    # float32: unchanged, bit for bit
    assert torch.equal(pixels_to_model_range(pixels, torch.float32), pixels.float() / 255.0 * 2.0 - 1.0)
    assert torch.equal(pixels_to_model_range(pixels, torch.float32), upstream_pixels(pixels, torch.float32))


# ------------------------------------------------------------------------------------------------ UMT5

TINY_TEXT = {"vocab_size": 64, "d_model": 64, "d_kv": 16, "d_ff": 96, "num_layers": 2, "num_heads": 4}


def _t5_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan T5LayerNorm: statistics in float32, rounded to the weight's dtype, then scaled."""
    x = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.type_as(weight)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Wan T5's GELU, op by op."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def upstream_umt5(encoder: TextEncoder, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Wan's T5Encoder (wan_video_text_encoder.py) on the same weights: per block x + attn(norm1(x)), x + ffn(norm2(x));
    T5Attention: bias = zeros + relative-position bias, masked to finfo.min; scores = einsum(q, k) + bias (no scaling);
    softmax(scores.float()).type_as(scores); einsum(probs, v); o. Then the final norm and encode_prompt's zeroing."""
    model = encoder.model
    eps = model.config.layer_norm_epsilon
    x = model.shared(ids)
    b, length = ids.shape
    for block in model.encoder.block:
        attention, ffn = block.layer[0], block.layer[1]
        sa = attention.SelfAttention
        n, c = sa.n_heads, sa.key_value_proj_dim
        y = _t5_norm(x, attention.layer_norm.weight, eps)
        q, k, v = (proj(y).view(b, length, n, c) for proj in (sa.q, sa.k, sa.v))
        bias = y.new_zeros(b, n, length, length)
        bias += sa.compute_bias(length, length)
        bias.masked_fill_(mask.view(b, 1, 1, length) == 0, torch.finfo(y.dtype).min)
        scores = torch.einsum("binc,bjnc->bnij", q, k) + bias
        probs = F.softmax(scores.float(), dim=-1).type_as(scores)
        x = x + sa.o(torch.einsum("bnij,bjnc->binc", probs, v).reshape(b, length, n * c))
        dense = ffn.DenseReluDense
        y = _t5_norm(x, ffn.layer_norm.weight, eps)
        x = x + dense.wo(dense.wi_1(y) * _gelu_tanh(dense.wi_0(y)))
    x = _t5_norm(x, model.encoder.final_layer_norm.weight, eps)
    return x.masked_fill((torch.arange(length) >= mask.sum(1, keepdim=True))[..., None], 0.0)


@pytest.fixture(scope="module")
def text_inputs() -> tuple[TextEncoder, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    encoder = TextEncoder.from_config(TINY_TEXT).to(BF16)
    with torch.no_grad():
        for p in encoder.parameters():  # larger logits than the init gives, so the probabilities' rounding shows
            p.mul_(4.0)
    ids = torch.randint(1, 64, (1, 24))
    mask = torch.ones_like(ids)
    mask[:, 17:] = 0
    return encoder, ids, mask


def test_umt5_uses_eager_attention_which_rounds_probabilities_like_upstream(text_inputs):
    encoder, ids, mask = text_inputs
    assert encoder.model.config._attn_implementation == "eager"
    with torch.device("meta"):
        assert TextEncoder.from_config(TINY_TEXT).model.config._attn_implementation == "eager"  # the loader's path
    with torch.no_grad():
        ours = encoder(ids, mask)
        reference = upstream_umt5(encoder, ids, mask)
        encoder.model.set_attn_implementation("sdpa")
        try:
            sdpa = encoder(ids, mask)
        finally:
            encoder.model.set_attn_implementation("eager")
    assert ours.dtype == BF16 and torch.equal(ours, reference)
    assert _differs(sdpa, reference)


def test_umt5_float32_matches_upstream(text_inputs):
    encoder, ids, mask = text_inputs
    encoder = TextEncoder.from_config(TINY_TEXT)
    encoder.load_state_dict({k: v.float() for k, v in text_inputs[0].state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(encoder(ids, mask), upstream_umt5(encoder, ids, mask), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ VAE RMS norm


def upstream_rms_norm(x: torch.Tensor, norm: WanRMS_norm) -> torch.Tensor:
    """wan_video_vae.py RMS_norm: F.normalize = x / max(||x||_2, eps) over channels, then * scale, * gamma, + bias,
    each in whatever dtype the operands give (bf16 without autocast)."""
    denominator = torch.linalg.vector_norm(x, dim=1 if norm.channel_first else -1, keepdim=True).clamp_min(1e-12)
    return (x / denominator) * norm.scale * norm.gamma + norm.bias


def _norm(channels: int, images: bool, dtype: torch.dtype) -> tuple[WanRMS_norm, UpstreamRMSNorm]:
    diffusers_norm = WanRMS_norm(channels, images=images)
    with torch.no_grad():
        diffusers_norm.gamma.copy_(1.0 + 0.3 * torch.randn_like(diffusers_norm.gamma))
    ours = WanRMS_norm(channels, images=images)
    ours.load_state_dict(diffusers_norm.state_dict())
    ours.__class__ = UpstreamRMSNorm
    return diffusers_norm.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("images", [False, True])  # residual blocks (5-D) and the attention block's norm (4-D)
def test_vae_rms_norm_rounds_in_bf16_like_upstream(images):
    torch.manual_seed(1)
    diffusers_norm, ours = _norm(96, images, BF16)
    x = (3.0 * torch.randn(2, 96, 3, 8, 8) if not images else 3.0 * torch.randn(2, 96, 8, 8)).to(BF16)
    with torch.no_grad():
        out = ours(x)
        assert out.dtype == BF16 and torch.equal(out, upstream_rms_norm(x, ours))
        assert _differs(out, diffusers_norm(x))  # diffusers normalizes in float32 and rounds once


def test_vae_rms_norm_float32_is_unchanged():
    torch.manual_seed(2)
    diffusers_norm, ours = _norm(32, False, torch.float32)
    x = torch.randn(2, 32, 3, 5, 5)
    with torch.no_grad():
        assert torch.equal(ours(x), diffusers_norm(x))


def test_video_vae_swaps_every_norm_and_keeps_float32_bit_identical():
    torch.manual_seed(3)
    cfg = {"base_dim": 8, "num_res_blocks": 1}
    plain = AutoencoderKLWan.from_config({**VideoVAE.from_config(cfg).model.config})
    ours = VideoVAE.from_config(cfg)
    ours.model.load_state_dict(plain.state_dict())
    norms = [m for m in ours.model.modules() if isinstance(m, WanRMS_norm)]
    assert norms and all(type(m) is UpstreamRMSNorm for m in norms)
    assert set(ours.model.state_dict()) == set(plain.state_dict())  # no state added
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(ours.model.encode(video).latent_dist.mean, plain.encode(video).latent_dist.mean)
        ours_bf16, plain_bf16 = ours.model.to(BF16), plain.to(BF16)
        assert _differs(ours_bf16.encode(video.to(BF16)).latent_dist.mean, plain_bf16.encode(video.to(BF16)).latent_dist.mean)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast (upstream's window-start encode) needs a GPU")
def test_vae_rms_norm_under_cuda_autocast_stays_float32_like_upstream():
    torch.manual_seed(4)
    _, ours = _norm(96, False, BF16)
    ours = ours.cuda()
    x = (3.0 * torch.randn(2, 96, 3, 8, 8)).to(BF16).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=BF16):
        out, reference = ours(x), upstream_rms_norm(x, ours)
    assert out.dtype == torch.float32 and torch.equal(out, reference)
    with torch.no_grad():
        assert _differs(out, ours(x).float())  # without autocast it rounds in bf16 (upstream's re-encode)


# ------------------------------------------------------------------------------------------------ action encoder


def test_action_encoder_swish_rounds_twice_like_upstream():
    torch.manual_seed(5)
    encoder = MultiEmbodimentActionEncoder(action_dim=32, dim=128).to(BF16)
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    actions = torch.randn(1, 24, 32).to(BF16)
    timesteps = torch.full((1, 24), 731)
    category = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        ours = encoder(actions, timesteps, category)
        # upstream: a = W1(actions); tau = pos_encoding(t).to(a.dtype); x = W2(cat); swish(x) = x * sigmoid(x); W3
        from ardiff_policies.dreamzero.dit import action_timestep_encoding

        a = encoder.W1(actions, category)
        x = encoder.W2(torch.cat([a, action_timestep_encoding(timesteps, 128).to(a.dtype)], dim=-1), category)
        sigmoid = torch.sigmoid(x)  # rounded to bf16
        reference = encoder.W3(x * sigmoid, category)  # rounded again
        assert ours.dtype == BF16 and torch.equal(ours, reference)
        assert _differs(ours, encoder.W3(F.silu(x), category))  # one rounding: the old placement
