#!/usr/bin/env python
"""Record what upstream DreamZero's eval transforms make of one raw observation, per embodiment.

Runs upstream's own code (dreamzero0/dreamzero, imported from ``--upstream``) on deterministic raw
observations and writes the reference ``tests/policies/test_embodiment_parity.py`` compares this server with:

* the composed training config of each embodiment upstream defines (oxe_droid, agibot, yam): upstream's
  hydra yaml files merged in hydra's order (transform/base, transform/dreamzero_cotrain, data base_48,
  data <tag>_relative, then the training scripts' command-line values with the tiny view size), its
  modality keys, relative keys, normalization modes, crop scale, embodiment ids, default instruction;
* ``GrootSimPolicy``'s eval path without the model: ``eval_transform`` (``instantiate(transforms[tag])``,
  ``set_metadata``, ``eval()``) on the batched observation (``unsqueeze_dict_values``) gives the canvas
  pixels, the normalized state and the token ids (plus the exact text handed to the tokenizer);
  ``GrootSimPolicy.unapply`` on a fixed raw model output gives the denormalized, absolute actions;
* ``collate``'s prompt template for every embodiment id it knows (and that it fails for others).

Run it in a separate environment with upstream's dependencies (never the project's .venv), e.g.::

    git -C /work/.mirror/dreamzero0+dreamzero/repo archive HEAD | tar -x -C /tmp/dreamzero-src
    python3.11 -m venv /tmp/upstream-venv && /tmp/upstream-venv/bin/pip install torch==2.13.0 torchvision==0.28.0 \\
        numpy==1.26.4 pydantic einops transformers ftfy regex dm-tree albumentations==1.4.18 opencv-python-headless \\
        omegaconf hydra-core tianshou==0.5.1 gymnasium tokenizers
    for v in tiny tiny_agibot tiny_yam; do .venv/bin/python scripts/make_tiny_checkpoint.py --variant $v --out /tmp/ckpt-$v; done
    /tmp/upstream-venv/bin/python scripts/record_upstream_embodiments.py --upstream /tmp/dreamzero-src \\
        --droid /tmp/ckpt-tiny --agibot /tmp/ckpt-tiny_agibot --yam /tmp/ckpt-tiny_yam \\
        --out tests/reference_data/upstream_embodiments.npz

Only upstream's code computes a recorded value; this script supplies inputs and copies outputs. The raw
inputs are regenerated from ``SEED`` by the test (their sha256 is recorded to prove it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

SEED = 2020
RAW_SIZE = (40, 64)  # (height, width) of the raw camera frames: 95 % crop -> 38x60
VIEW_SIZE = (24, 40)  # per-view resize (the training scripts' 176x320 at toy size)
FRAMES = (1, 4)  # a session's first call, then a 4-frame stack
MODEL_ACTION_DIM, HORIZON = 32, 24
PROMPTS = ("Pick up the Cup.", "['Fold the Towel', 'other']", "<COTRAIN>Stack  the\tblocks &amp; cups", "")
LANGUAGE_KEY = {"oxe_droid": "annotation.language.language_instruction", "agibot": "annotation.language.action_text", "yam": "annotation.task"}
TEMPLATE_TAGS = ("agibot", "oxe_droid", "gr1_unified", "mecka_hands", "xdof", "yam", "lapa", "oxe_bridge")


def raw_inputs(tag: str, cameras: list[str], states: dict[str, int], frames: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Deterministic raw frames (uint8) and states (float64, (1, dim), some beyond q01 / q99) of one observation.
    ``tests/policies/test_embodiment_parity.py`` regenerates them with this same function."""
    rng = np.random.default_rng([SEED, sum(tag.encode()), frames])
    images = {c: rng.integers(0, 256, (frames, *RAW_SIZE, 3), dtype=np.uint8) for c in cameras}
    state = {k: rng.uniform(-3.5, 3.5, (1, d)) for k, d in states.items()}
    return images, state


def raw_model_output(tag: str) -> np.ndarray:
    """A fixed raw action prediction (1, horizon, 32) in model space, a little beyond [-1, 1] here and there."""
    return np.random.default_rng([SEED, sum(tag.encode()), 99]).normal(0.0, 0.6, (1, HORIZON, MODEL_ACTION_DIM)).astype(np.float32)


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(arrays):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arrays[key]).tobytes())
    return h.hexdigest()


def compose(upstream: Path, tag: str, tokenizer: Path):
    """Upstream's hydra composition for one embodiment's training run, as a plain OmegaConf."""
    from omegaconf import OmegaConf

    configs = upstream / "groot" / "vla" / "configs"

    def load(path: Path):
        cfg = OmegaConf.load(path)
        cfg.pop("defaults", None)
        return cfg

    data_yaml = {"oxe_droid": "droid_relative.yaml", "agibot": "agibot_relative.yaml", "yam": "yam_relative.yaml"}[tag]
    parts = [
        load(configs / "model" / "dreamzero" / "transform" / "base.yaml"),
        load(configs / "model" / "dreamzero" / "transform" / "dreamzero_cotrain.yaml"),
        load(configs / "data" / "dreamzero" / "base_48_wan_fine_aug_relative.yaml"),
        load(configs / "data" / "dreamzero" / data_yaml),
        OmegaConf.create(
            {  # the training scripts' command line (scripts/train/<tag>_training.sh), toy view size
                "num_frames": 33,
                "action_horizon": 24,
                "num_views": 3,
                "image_resolution_height": VIEW_SIZE[0],
                "image_resolution_width": VIEW_SIZE[1],
                "tokenizer_path": str(tokenizer),
                f"{tag}_data_root": "/nonexistent",
                "droid_data_root": "/nonexistent",
            }
        ),
    ]
    return OmegaConf.merge(*parts)


def metadata_for(checkpoint: Path, tag: str, states: list[str], actions: list[str]) -> dict:
    """The checkpoint's metadata.json entry, with the raw frame size as the video resolution (upstream's VideoCrop
    asserts frames of exactly that size) and, where the tiny DROID's lacks them, modalities from the statistics."""
    entry = json.loads((checkpoint / "experiment_cfg" / "metadata.json").read_text())[tag]
    modalities = entry.get("modalities") or {}
    cameras = modalities.get("video")
    if isinstance(cameras, list) or not cameras:  # tiny DROID: a list of names
        cameras = {c: {} for c in (cameras or [])}
    h, w = RAW_SIZE
    video = {c: {"resolution": [w, h], "channels": 3, "fps": 15.0} for c in cameras}

    def table(kind: str, keys: list[str]) -> dict:
        given = modalities.get(kind) if isinstance(modalities.get(kind), dict) else {}
        return {
            k: given.get(k) or {"absolute": True, "rotation_type": None, "shape": [len(entry["statistics"][kind][k]["q01"])], "continuous": True}
            for k in keys
        }

    entry["modalities"] = {"video": video, "state": table("state", states), "action": table("action", actions)}
    entry["embodiment_tag"] = tag
    return entry


def record_embodiment(upstream: Path, tag: str, checkpoint: Path, out: dict[str, np.ndarray], facts: dict) -> None:
    import torch
    from groot.vla.data.schema import DatasetMetadata
    from groot.vla.model.n1_5.sim_policy import GrootSimPolicy, squeeze_dict_values, unsqueeze_dict_values
    from hydra.utils import instantiate
    from tianshou.data import Batch

    cfg = compose(upstream, tag, checkpoint / "tokenizer")
    modality = cfg.modality_configs[tag]
    video_keys = list(modality.video.modality_keys)
    state_keys = [k.split(".", 1)[1] for k in modality.state.modality_keys]
    action_keys = [k.split(".", 1)[1] for k in modality.action.modality_keys]
    transform_cfg = cfg.transforms[tag]
    steps = {str(t._target_).rsplit(".", 1)[-1]: t for t in transform_cfg.transforms}
    facts[tag] = {
        "cameras": [k.split(".", 1)[1] for k in video_keys],
        "states": state_keys,
        "actions": action_keys,
        "relative_action": bool(cfg.relative_action),
        "relative_action_keys": list(cfg.relative_action_keys),
        "relative_action_per_horizon": bool(cfg.relative_action_per_horizon),
        "normalization_modes": {
            str(k): str(v)
            for t in transform_cfg.transforms
            if str(t._target_).endswith("StateActionTransform")
            for k, v in t.normalization_modes.items()
        },
        "crop_scale": float(steps["VideoCrop"].scale),
        "view_size": [int(steps["VideoResize"].height), int(steps["VideoResize"].width)],
        "embodiment_id": int(cfg.embodiment_tag_to_projector_index[tag]),
        "embodiment_tag_to_projector_index": {str(k): int(v) for k, v in cfg.embodiment_tag_to_projector_index.items()},
        "default_instruction": str(steps["DreamTransform"].default_instruction),
        "max_state_dim": int(steps["DreamTransform"].max_state_dim),
    }

    metadata = DatasetMetadata.model_validate(metadata_for(checkpoint, tag, state_keys, action_keys))
    state_dims = {k: int(metadata.modalities.state[k].shape[0]) for k in state_keys}
    eval_transform = instantiate(transform_cfg)
    eval_transform.set_metadata(metadata)
    eval_transform.eval()
    policy = GrootSimPolicy.__new__(GrootSimPolicy)  # the eval path's methods, without loading a model
    policy.eval_transform, policy.train_cfg = eval_transform, cfg

    # The exact strings handed to the HF tokenizer (HuggingfaceTokenizer cleans, then calls it).
    hf = eval_transform.transforms[-1].tokenizer.tokenizer
    seen: list[str] = []
    original_call = type(hf).__call__

    def spy(self, text, *args, **kwargs):
        seen.extend([text] if isinstance(text, str) else list(text))
        return original_call(self, text, *args, **kwargs)

    type(hf).__call__ = spy
    try:
        for frames in FRAMES:
            for p, prompt in enumerate((*PROMPTS, None)):
                if prompt is None and tag == "oxe_droid":
                    continue  # DROID's server sends "" for a missing prompt; the eval transform's default is recorded for the others
                images, state = raw_inputs(tag, facts[tag]["cameras"], state_dims, frames)
                obs = {f"video.{c}": v for c, v in images.items()} | {f"state.{k}": v for k, v in state.items()}
                if prompt is not None:
                    obs[LANGUAGE_KEY[tag]] = prompt
                original = unsqueeze_dict_values({k: v.copy() if isinstance(v, np.ndarray) else v for k, v in obs.items()})
                eval_transform.transforms[-1]._language_key = eval_transform.transforms[-1]._language_keys = None
                seen.clear()
                normalized = policy.apply(Batch(obs=unsqueeze_dict_values(obs))).normalized_obs
                name = f"{tag}/f{frames}/p{p if prompt is not None else 'none'}"
                out[f"{name}/raw_sha256"] = np.array(digest({**images, **state}))
                assert len(seen) == 2, seen  # collate tokenizes the negative prompt, then the prompt
                out[f"{name}/negative_text"], out[f"{name}/text"] = np.array(seen[0]), np.array(seen[1])
                out[f"{name}/input_ids"] = np.asarray(normalized["text"][0]).astype(np.int32)
                out[f"{name}/attention_mask"] = np.asarray(normalized["text_attention_mask"][0]).astype(np.int8)
                if p == 0:  # pixels and state do not depend on the prompt
                    out[f"{name}/canvas"] = np.asarray(normalized["images"][0]).astype(np.uint8)
                    out[f"{name}/state"] = np.asarray(normalized["state"][0, 0]).astype(np.float64)
                    out[f"{name}/state_mask"] = np.asarray(normalized["state_mask"][0, 0]).astype(bool)
                    out[f"{name}/embodiment_id"] = np.array(int(normalized["embodiment_id"][0]))
                    if frames == 1:
                        raw = raw_model_output(tag)
                        act = policy.unapply(Batch(normalized_action=torch.from_numpy(raw)), obs=original).act
                        act = squeeze_dict_values(dict(act))
                        out[f"{tag}/raw_action"] = raw[0]
                        out[f"{tag}/actions"] = np.concatenate([np.asarray(act[f"action.{k}"]).reshape(HORIZON, -1) for k in action_keys], axis=1)
                        print(f"{tag}: actions {out[f'{tag}/actions'].shape}", file=sys.stderr)
    finally:
        type(hf).__call__ = original_call


def record_templates(upstream: Path, tokenizer: Path, out: dict[str, np.ndarray], facts: dict) -> None:
    """collate's text for each embodiment id (a fixed prompt), and which ids it refuses."""
    from groot.vla.model.dreamzero.transform.dreamzero_cotrain import HuggingfaceTokenizer, collate

    ids = facts["agibot"]["embodiment_tag_to_projector_index"]
    seen: list[str] = []

    class Recording(HuggingfaceTokenizer):
        def __call__(self, sequence, **kwargs):
            seen.extend(self._clean(u) for u in sequence)
            return super().__call__(sequence, **kwargs)

    tok = Recording(str(tokenizer), seq_len=512, clean="whitespace")
    refused = []
    for tag in TEMPLATE_TAGS:
        for num_views in (1, 3):
            seen.clear()
            try:
                collate([{"text": "Wipe The Table", "embodiment_id": ids[tag]}], tok, num_views, ids)
            except ValueError:
                refused.append(f"{tag}/{num_views}")
                continue
            out[f"template/{tag}/views{num_views}"] = np.array(seen[0])
    facts["template_refused"] = refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, required=True, help="an export of dreamzero0/dreamzero")
    parser.add_argument("--droid", type=Path, required=True, help="tiny DROID checkpoint (make_tiny_checkpoint.py --variant tiny)")
    parser.add_argument("--agibot", type=Path, required=True, help="tiny AgiBot checkpoint (--variant tiny_agibot)")
    parser.add_argument("--yam", type=Path, required=True, help="tiny YAM checkpoint (--variant tiny_yam)")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write (facts go into its 'facts' entry)")
    args = parser.parse_args()
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    sys.path.insert(0, str(args.upstream.resolve()))
    import torch

    torch.manual_seed(0)
    out: dict[str, np.ndarray] = {}
    facts: dict = {"upstream_commit": os.environ.get("UPSTREAM_COMMIT", "unknown"), "torch": torch.__version__, "numpy": np.__version__}
    for tag, checkpoint in (("oxe_droid", args.droid), ("agibot", args.agibot), ("yam", args.yam)):
        record_embodiment(args.upstream, tag, checkpoint, out, facts)
    record_templates(args.upstream, args.agibot / "tokenizer", out, facts)
    out["facts"] = np.array(json.dumps(facts, sort_keys=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as file:
        np.savez_compressed(file, **out)
    print(f"wrote {args.out}: {len(out)} arrays, {args.out.stat().st_size / 1024:.0f} KiB", file=sys.stderr)


if __name__ == "__main__":
    main()
