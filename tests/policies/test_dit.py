"""The DreamZero DiT against independent anchors: diffusers' Wan transformer, upstream's own
recorded outputs, and upstream's concat-and-slice KV path."""

from __future__ import annotations

import json

import pytest
import torch

from ardiff_kv import Branch, DenseKVCache, KVSpec, PagedKVCache
from ardiff_policies.dreamzero.checkpoint import CheckpointError, WeightFiles, load_component
from ardiff_policies.dreamzero.dit import CausalWanModel, DiTConfig
from ardiff_policies.dreamzero.naming import DIT_PREFIX, identity_targets
from tests.helpers.reference import REFERENCE_DIR

REFERENCE = REFERENCE_DIR / "upstream_dit_tiny"

TINY = DiTConfig(
    frame_seqlen=15,
    dim=64,
    ffn_dim=128,
    text_dim=32,
    num_heads=4,
    num_layers=2,
    hidden_size=32,
    clip_dim=48,
    max_chunk_size=4,
    num_frame_per_block=2,
)


def randomized(cfg: DiTConfig, seed: int = 0) -> CausalWanModel:
    """A DiT with every tensor random (incl. norms/modulation, so no term is trivially zero)."""
    torch.manual_seed(seed)
    model = CausalWanModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.15) + (1.0 if "norm" in name and "weight" in name else 0.0))
    return model


# ---------------------------------------------------------------- diffusers parity


def to_diffusers_key(key: str) -> str | None:
    """This DiT's (= upstream's) names -> diffusers ``WanTransformer3DModel`` names."""
    if key.startswith(("action_encoder.", "action_decoder.", "state_encoder.")):
        return None  # the action register has no counterpart in plain Wan
    fixed = {
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj",
        "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
        "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
        "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
        "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
        "head.head": "proj_out",
        "head.modulation": "scale_shift_table",
    }
    for ours, theirs in fixed.items():
        if key.startswith(ours + ".") or key == ours:
            return theirs + key[len(ours) :]
    if not key.startswith("blocks."):
        return key
    _, index, rest = key.split(".", 2)
    block = {
        "self_attn.q": "attn1.to_q",
        "self_attn.k": "attn1.to_k",
        "self_attn.v": "attn1.to_v",
        "self_attn.o": "attn1.to_out.0",
        "self_attn.norm_q": "attn1.norm_q",
        "self_attn.norm_k": "attn1.norm_k",
        "cross_attn.q": "attn2.to_q",
        "cross_attn.k": "attn2.to_k",
        "cross_attn.v": "attn2.to_v",
        "cross_attn.o": "attn2.to_out.0",
        "cross_attn.norm_q": "attn2.norm_q",
        "cross_attn.norm_k": "attn2.norm_k",
        "cross_attn.k_img": "attn2.add_k_proj",
        "cross_attn.v_img": "attn2.add_v_proj",
        "cross_attn.norm_k_img": "attn2.norm_added_k",
        "norm3": "norm2",  # upstream's cross-attention norm is diffusers' norm2
        "ffn.0": "ffn.net.0.proj",
        "ffn.2": "ffn.net.2",
        "modulation": "scale_shift_table",
    }
    for ours, theirs in block.items():
        if rest.startswith(ours + ".") or rest == ours:
            return f"blocks.{index}.{theirs}{rest[len(ours) :]}"
    raise KeyError(key)


def test_matches_diffusers_wan_transformer_i2v():
    from diffusers import WanTransformer3DModel

    cfg = TINY
    ours = randomized(cfg)
    theirs = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=36,
        out_channels=16,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
        image_dim=cfg.clip_dim,
        added_kv_proj_dim=cfg.dim,
    ).eval()
    converted = {to_diffusers_key(k): v for k, v in ours.state_dict().items() if to_diffusers_key(k)}
    theirs.load_state_dict(converted, strict=True)

    torch.manual_seed(1)
    frames, t = 3, 637
    x, y = torch.randn(1, 16, frames, 6, 10), torch.randn(1, 20, frames, 6, 10)
    context, clip = torch.randn(1, 512, cfg.text_dim), torch.randn(1, 257, cfg.clip_dim)
    with torch.no_grad():
        video, action = ours(x, torch.full((1, frames), t), current_start_frame=0, self_kv=None, y=y, context=context, clip_feature=clip)
        expected = theirs(
            hidden_states=torch.cat([x, y], 1), timestep=torch.tensor([t]), encoder_hidden_states=context, encoder_hidden_states_image=clip
        ).sample
    assert action is None
    torch.testing.assert_close(video, expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- upstream parity


@pytest.mark.skipif(not REFERENCE.exists(), reason=f"upstream reference rollout not found at {REFERENCE}")
def test_reproduces_upstream_recorded_rollout_through_the_loader_and_paged_kv():
    from safetensors.torch import load_file

    meta = json.loads((REFERENCE / "rollout.json").read_text())
    raw = {k: v for k, v in meta["config"].items() if k != "local_attn_size"}
    cfg = DiTConfig.from_dict({**raw, "hidden_size": 1024})
    assert cfg.local_attn_size == meta["config"]["local_attn_size"]
    with torch.device("meta"):
        model = CausalWanModel(cfg)
    load_component(
        model, WeightFiles.from_files([REFERENCE / "weights.safetensors"]), DIT_PREFIX, identity_targets, dtype=torch.float32, device="cpu"
    )
    model.eval()

    rollout = load_file(REFERENCE / "rollout.safetensors")
    text = load_file(REFERENCE / "context.safetensors")
    spec = KVSpec(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        page_size=cfg.frame_seqlen,
        window_pages=cfg.local_attn_size,
        max_new_pages=cfg.num_frame_per_block,
        max_extra_tokens=cfg.action_register_length,
    )
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    session = cache.open_session("reference")
    clip = None
    checked = 0
    for call in meta["calls"]:
        key, branch = call["key"], Branch.COND if call["branch"] == "positive" else Branch.UNCOND
        call_index = int(call["tag"].split("/")[0][4:])
        window_start = f"window{call_index}.clip_feature" in rollout and call["tag"].endswith("prefill_first_frame")
        if window_start and (clip is None or branch == Branch.COND):
            clip = rollout[f"window{call_index}.clip_feature"]
            if call_index:
                session.restart_window(keep_cross_text=True)  # the window restart upstream does
        x = rollout[f"{key}.x"]
        ctx = session.begin_forward(
            branch,
            num_video_tokens=x.shape[2] * cfg.frame_seqlen,
            commit=call["update_kv_cache"],
            extra_tokens=cfg.action_register_length if call["has_action"] else 0,
        )
        with torch.no_grad():
            video, action = model(
                x,
                rollout[f"{key}.timestep"],
                current_start_frame=call["current_start_frame"],
                self_kv=ctx.prepare(),
                y=rollout[f"{key}.y"],
                context=text[f"text_context.{call['branch']}"],
                clip_feature=clip,
                action=rollout.get(f"{key}.action"),
                timestep_action=rollout.get(f"{key}.timestep_action"),
                state=rollout.get(f"{key}.state"),
            )
        session.complete(branch)
        if call["kv_tokens_before_call"] is not None:
            assert len(session.branch(branch).resident) * cfg.frame_seqlen == call["kv_tokens_before_call"]
        torch.testing.assert_close(video, rollout[f"{key}.video_pred"], atol=1e-4, rtol=0)
        if call["has_action"]:
            torch.testing.assert_close(action, rollout[f"{key}.action_pred"], atol=1e-4, rtol=0)
        checked += 1
    assert checked == 36


def test_loader_names_missing_unexpected_and_misshapen_tensors(tmp_path):
    from safetensors.torch import save_file

    model = randomized(TINY)
    state = {DIT_PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}
    state.pop(DIT_PREFIX + "head.head.bias")
    state[DIT_PREFIX + "blocks.0.self_attn.q.weight"] = torch.zeros(3, 3)
    state[DIT_PREFIX + "blocks.7.extra.weight"] = torch.zeros(1)
    save_file(state, tmp_path / "model.safetensors")
    with torch.device("meta"):
        target = CausalWanModel(TINY)
    with pytest.raises(CheckpointError) as err:
        load_component(target, WeightFiles.from_directory(tmp_path), DIT_PREFIX, identity_targets, dtype=torch.float32, device="cpu")
    message = str(err.value)
    assert "missing 2: blocks.0.self_attn.q.weight, head.head.bias" in message
    assert "blocks.7.extra.weight" in message
    assert "blocks.0.self_attn.q.weight: checkpoint (3, 3) vs model (64, 64)" in message


def test_truncated_shard_is_a_checkpoint_error(tmp_path):
    from safetensors.torch import save_file

    save_file({DIT_PREFIX + "x": torch.zeros(1000)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        WeightFiles.from_directory(tmp_path)


# ------------------------------------------------------------- paged vs concat-and-slice


def dreamzero_rollout(model: CausalWanModel, cfg: DiTConfig, calls: int, use_paged: bool) -> list[torch.Tensor]:
    """Drive the DiT in upstream's call order (prefill, then denoise steps), both CFG branches."""
    torch.manual_seed(7)
    h, w = 6, 10
    contexts = {b: torch.randn(1, cfg.text_len, cfg.text_dim) for b in Branch}
    clip = torch.randn(1, cfg.num_image_tokens, cfg.clip_dim)
    ys = torch.randn(1, 20, cfg.local_attn_size, h, w)
    spec = KVSpec(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        page_size=cfg.frame_seqlen,
        window_pages=cfg.local_attn_size,
        max_new_pages=2,
        max_extra_tokens=cfg.action_register_length,
    )
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1)
    session = cache.open_session("s")
    dense = {b: DenseKVCache(cfg.num_layers, cfg.local_attn_size * cfg.frame_seqlen) for b in Branch}
    outputs = []
    csf = 0
    for _ in range(calls):
        if csf >= cfg.local_attn_size:
            csf = 0
            session.restart_window(keep_cross_text=True)
            for d in dense.values():
                d.reset()
        prefill = [(1, 0)] if csf == 0 else [(2, csf - 2)]
        if csf == 0:
            csf = 1
        for frames, start in prefill:
            x = torch.randn(1, 16, frames, h, w)
            for b in Branch:
                if use_paged:
                    kv = session.begin_forward(b, num_video_tokens=frames * cfg.frame_seqlen, commit=True).prepare()
                else:
                    kv = dense[b].layers(update=True)
                with torch.no_grad():
                    model(
                        x,
                        torch.zeros(1, frames, dtype=torch.long),
                        current_start_frame=start,
                        self_kv=kv,
                        y=ys[:, :, start : start + frames],
                        context=contexts[b],
                        clip_feature=clip,
                    )
                if use_paged:
                    session.complete(b)
        for step in range(3):
            x = torch.randn(1, 16, 2, h, w)
            action, state = torch.randn(1, 24, cfg.action_dim), torch.randn(1, 1, cfg.max_state_dim)
            for b in Branch:
                if use_paged:
                    kv = session.begin_forward(
                        b, num_video_tokens=2 * cfg.frame_seqlen, commit=False, extra_tokens=cfg.action_register_length
                    ).prepare()
                else:
                    kv = dense[b].layers(update=False)
                with torch.no_grad():
                    video, act = model(
                        x,
                        torch.full((1, 2), 900 - 100 * step),
                        current_start_frame=csf,
                        self_kv=kv,
                        y=ys[:, :, csf : csf + 2],
                        context=contexts[b],
                        clip_feature=clip,
                        action=action,
                        timestep_action=torch.full((1, 24), 900 - 100 * step),
                        state=state,
                    )
                if use_paged:
                    session.complete(b)
                outputs += [video, act]
        csf += 2
    return outputs


def test_paged_rollout_equals_concat_and_slice_over_two_window_resets():
    cfg = TINY
    model = randomized(cfg, seed=3)
    calls = 13  # csf 0 -> 3 -> 5 -> 7 -> 9 (reset) -> ... : two restarts
    paged = dreamzero_rollout(model, cfg, calls, use_paged=True)
    dense = dreamzero_rollout(model, cfg, calls, use_paged=False)
    assert len(paged) == calls * 3 * 2 * 2
    for a, b in zip(paged, dense):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_config_rejects_unknown_keys_and_knows_the_window():
    with pytest.raises(ValueError, match="unknown DiT config keys"):
        DiTConfig.from_dict({"dim": 64, "num_heads": 4, "mystery": 1})
    assert DiTConfig().local_attn_size == 9 and DiTConfig(max_chunk_size=-1).local_attn_size == 21
    assert DiTConfig.from_dict(DiTConfig().to_dict()) == DiTConfig()
