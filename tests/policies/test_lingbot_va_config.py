"""The lingbot_va policy section: every key read or refused by name (torch-free validation)."""

from __future__ import annotations

import pydantic
import pytest

from ardiff_policies.lingbot_va.config import LingBotVAConfig
from ardiff_server.config import ConfigError, load_config, validate_config


def test_shipped_configs_validate_and_name_their_checkpoints():
    for name, checkpoint, embodiment in (
        ("tiny_lingbot_va", "builtin:tiny", "tiny_robotwin"),
        ("lingbot_va_robotwin", "robbyant/lingbot-va-posttrain-robotwin", "robotwin"),
        ("lingbot_va_franka", "robbyant/lingbot-va-base", "franka"),
        ("lingbot_va_libero", "robbyant/lingbot-va-posttrain-libero-long", "libero"),
        ("tiny_lingbot_va_libero", "builtin:tiny", "tiny_libero"),
    ):
        options = load_config(name).policy_options()
        assert (options.checkpoint, options.embodiment_name) == (checkpoint, embodiment)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"guidance": 5}, "guidance"),
        ({"checkpoint": "builtin:tiny", "embodiment": "franka"}, "tiny geometries only"),
        ({"checkpoint": "synthetic:tiny", "embodiment": "libero"}, r"tiny geometries only \(tiny_robotwin, tiny_libero\)"),
        ({"checkpoint": "/models/lingbot", "embodiment": "tiny_robotwin"}, "builtin:tiny and synthetic:tiny only"),
        ({"checkpoint": "/models/lingbot", "embodiment": "tiny_libero"}, "tiny_libero is a geometry of builtin:tiny"),
        ({"embodiment": "arms"}, "embodiment"),
        ({"checkpoint": "synthetic:huge"}, "unknown synthetic preset 'huge'"),
        ({"checkpoint": "builtin:small"}, "unknown 'builtin:small'"),
        ({"seed": -1}, "seed"),
    ],
)
def test_a_bad_setting_is_refused_by_name(section, words):
    with pytest.raises(pydantic.ValidationError, match=words):
        LingBotVAConfig.model_validate({"name": "lingbot_va", **section})


def test_a_checkpoint_without_the_released_layout_is_refused_at_preflight(tmp_path):
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ValueError, match="lacks vae/, text_encoder/, tokenizer/"):
        LingBotVAConfig(checkpoint=str(tmp_path)).preflight()
    with pytest.raises(ConfigError, match="unknown key"):
        validate_config({"policy": {"name": "lingbot_va", "steps": 3}}, source="<test>")
