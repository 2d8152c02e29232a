"""Per embodiment, the policy's inputs and outputs agree with upstream DreamZero's eval transforms.

``tests/reference_data/upstream_embodiments.npz`` was recorded from upstream's own code by
``scripts/record_upstream_embodiments.py`` (its docstring says how): upstream's composed training config
per embodiment, ``GrootSimPolicy``'s eval transform on raw observations (canvas pixels, normalized state,
the text handed to the tokenizer and its ids) and ``GrootSimPolicy.unapply`` on a fixed raw model output
(denormalized, absolute actions). The raw observations are regenerated here from the script's seed
(their recorded sha256 proves it) and go through this server's decoder and the policy's own methods.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from ardiff_policies.dreamzero.config import DEFAULT_NEGATIVE_PROMPT
from ardiff_policies.dreamzero.embodiments import (
    BUILTIN_MODALITIES,
    DROID_CAMERAS,
    PROJECTOR_INDEX,
    UPSTREAM_TEMPLATES,
    embodiment_prompt,
    read_experiment_config,
    render_prompt,
    resolve,
    upstream_template,
)
from ardiff_policies.dreamzero.inputs import InputEncoder
from ardiff_policies.dreamzero.policy import DreamZeroPolicy
from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint
from ardiff_policies.dreamzero.transforms import NormStats
from ardiff_policies.observation import RobotObservation
from ardiff_policies.wan.prompt import clean_prompt
from ardiff_server.wire.decode import decode_request
from tests.helpers.scripts import load_script

REFERENCE = Path(__file__).parents[1] / "reference_data" / "upstream_embodiments.npz"
# The recording's inputs, made by the recording script's own functions (it imports upstream only in main()).
RECORDER = load_script("record_upstream_embodiments")
VIEW_SIZE, FRAMES, PROMPTS = RECORDER.VIEW_SIZE, RECORDER.FRAMES, RECORDER.PROMPTS
raw_inputs, digest = RECORDER.raw_inputs, RECORDER.digest
VARIANT = {"oxe_droid": "tiny", "agibot": "tiny_agibot", "yam": "tiny_yam"}
TAGS = tuple(VARIANT)
TOLERANCE = 1e-6  # fp32 max abs


@pytest.fixture(scope="module")
def ref():
    with np.load(REFERENCE) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(str(arrays.pop("facts")))


def served(tag: str):
    """(checkpoint dir, the embodiment the policy serves from it)."""
    checkpoint = ensure_tiny_checkpoint(variant=VARIANT[tag])
    metadata = json.loads((checkpoint / "experiment_cfg" / "metadata.json").read_text())
    return checkpoint, resolve(metadata, read_experiment_config(checkpoint), tag=tag)


def policy_stub(embodiment) -> SimpleNamespace:
    """What InputEncoder's and DreamZeroPolicy's per-call methods read, at the reference's view size (the DiT is not involved)."""
    stub = SimpleNamespace(
        embodiment=embodiment,
        view_size=VIEW_SIZE,
        action_head_config=SimpleNamespace(max_state_dim=64),
        model=SimpleNamespace(vae=SimpleNamespace(is_wan22=False)),  # the 14B's camera path (the 5B resizes to its target first)
        state_stats=NormStats.from_quantiles(embodiment.state_stats),
        action_stats=NormStats.from_quantiles(embodiment.action_stats),
    )
    slices = embodiment.state_slices
    stub._relative = [(a, slices[k]) for k, a in embodiment.action_slices.items() if k in embodiment.relative_action_keys]
    return stub


def wire_request(tag: str, embodiment, images: dict, state: dict, prompt: str | None) -> dict:
    """The request a client sends: RoboArena's keys for DROID, observation/<name> otherwise."""
    if tag == "oxe_droid":
        request = {
            "observation/exterior_image_1_left": images["exterior_image_1_left"],
            "observation/exterior_image_2_left": images["exterior_image_2_left"],
            "observation/wrist_image_left": images["wrist_image_left"],
            **{f"observation/{k}": v for k, v in state.items()},
        }
    else:
        request = {f"observation/{k}": v for k, v in {**images, **state}.items()}
    if prompt is not None:
        request["prompt"] = prompt
    return request


def observe(tag: str, embodiment, frames: int, prompt: str | None, ref_arrays: dict, name: str) -> RobotObservation:
    cameras = [c for c in BUILTIN_MODALITIES[tag].cameras]
    images, state = raw_inputs(tag, cameras, {p.name: p.dim for p in embodiment.states}, frames)
    assert digest({**images, **state}) == str(ref_arrays[f"{name}/raw_sha256"]), "raw inputs differ from the recording's"
    schema = None if tag == "oxe_droid" else embodiment.schema((96, 160))
    return decode_request(wire_request(tag, embodiment, images, state, prompt), schema).observation


@pytest.mark.parametrize("tag", TAGS)
def test_built_in_definitions_are_upstreams_composed_config(ref, tag):
    _, facts = ref
    up = facts[tag]
    mod = BUILTIN_MODALITIES[tag]
    assert list(mod.cameras) == up["cameras"] and list(mod.states) == up["states"] and list(mod.actions) == up["actions"]
    assert up["relative_action"] and list(mod.relative_action_keys) == up["relative_action_keys"]
    assert up["embodiment_tag_to_projector_index"] == PROJECTOR_INDEX and PROJECTOR_INDEX[tag] == up["embodiment_id"]
    assert set(up["normalization_modes"].values()) == {"q99"} and up["crop_scale"] == 0.95
    # the tiny post-trained-style checkpoints' run config says the same (their conf.yaml is what the server reads)
    _, embodiment = served(tag)
    assert embodiment.cameras == (tuple(DROID_CAMERAS[c] for c in up["cameras"]) if tag == "oxe_droid" else tuple(up["cameras"]))
    assert [p.name for p in embodiment.states] == up["states"] and [p.name for p in embodiment.actions] == up["actions"]
    assert list(embodiment.relative_action_keys) == up["relative_action_keys"] and embodiment.embodiment_id == up["embodiment_id"]
    assert embodiment.crop_scale == up["crop_scale"]
    if tag != "oxe_droid":
        assert embodiment.default_instruction == up["default_instruction"]


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("tag", TAGS)
def test_canvas_pixels_and_normalized_state_are_upstreams_exactly(ref, tag, frames):
    arrays, _ = ref
    _, embodiment = served(tag)
    name = f"{tag}/f{frames}/p0"
    observation = observe(tag, embodiment, frames, PROMPTS[0], arrays, name)
    stub = policy_stub(embodiment)
    canvas = InputEncoder.canvas(stub, observation)
    expected = arrays[f"{name}/canvas"]
    assert canvas.shape == expected.shape and canvas.dtype == np.uint8
    np.testing.assert_array_equal(canvas, expected)
    state = DreamZeroPolicy._model_state(stub, DreamZeroPolicy._raw_state(stub, observation))
    np.testing.assert_allclose(state, arrays[f"{name}/state"], atol=TOLERANCE, rtol=0)
    assert int(arrays[f"{name}/state_mask"].sum()) == embodiment.state_dim and not state[embodiment.state_dim :].any()
    assert int(arrays[f"{name}/embodiment_id"]) == embodiment.embodiment_id


@pytest.mark.parametrize("tag", TAGS)
def test_prompt_text_and_token_ids_are_upstreams_exactly(ref, tag):
    arrays, _ = ref
    checkpoint, embodiment = served(tag)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"), local_files_only=True)
    cases = [*enumerate(PROMPTS)] + ([] if tag == "oxe_droid" else [("none", None)])
    for frames in FRAMES:
        for p, prompt in cases:
            name = f"{tag}/f{frames}/p{p}"
            observation = observe(tag, embodiment, frames, prompt, arrays, name)
            text = embodiment_prompt(embodiment, observation.prompt)
            assert text == str(arrays[f"{name}/text"]), name
            assert clean_prompt(DEFAULT_NEGATIVE_PROMPT) == str(arrays[f"{name}/negative_text"])
            # what InputEncoder.tokenize hands the text encoder
            stub = SimpleNamespace(model=SimpleNamespace(tokenizer=tokenizer), text_len=512, text_device="cpu")
            ids, mask = InputEncoder.tokenize(stub, text)
            np.testing.assert_array_equal(ids[0].numpy(), arrays[f"{name}/input_ids"])
            np.testing.assert_array_equal(mask[0].numpy(), arrays[f"{name}/attention_mask"])


@pytest.mark.parametrize("tag", TAGS)
def test_denormalized_actions_from_the_same_raw_output_are_upstreams(ref, tag):
    arrays, _ = ref
    _, embodiment = served(tag)
    observation = observe(tag, embodiment, 1, PROMPTS[0], arrays, f"{tag}/f1/p0")
    stub = policy_stub(embodiment)
    raw = torch.from_numpy(arrays[f"{tag}/raw_action"])[None]  # (1, horizon, 32) as the DiT returns it
    actions = DreamZeroPolicy._postprocess(stub, raw, DreamZeroPolicy._raw_state(stub, observation))
    expected = arrays[f"{tag}/actions"]
    assert actions.shape == expected.shape == (24, embodiment.action_dim) and actions.dtype == np.float32
    np.testing.assert_allclose(actions, expected, atol=TOLERANCE, rtol=0)


def test_every_template_upstreams_collate_knows_and_the_ids_it_refuses(ref):
    arrays, facts = ref
    for tag in ("agibot", "oxe_droid", "gr1_unified", "mecka_hands", "xdof", "yam", "lapa", "oxe_bridge"):
        for views in (1, 3):
            template = upstream_template(PROJECTOR_INDEX[tag], PROJECTOR_INDEX, views)
            key = f"template/{tag}/views{views}"
            if f"{tag}/{views}" in facts["template_refused"]:
                assert template is None and key not in arrays, key
            else:
                assert render_prompt(template, "Wipe The Table") == str(arrays[key]), key
    assert {tag for tag, _, _ in UPSTREAM_TEMPLATES} <= set(PROJECTOR_INDEX)
