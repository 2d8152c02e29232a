"""docs/options.md is what scripts/gen_options.py writes from the config models (regenerate it when an option changes)."""

from __future__ import annotations

import pydantic
import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def gen_options():
    return load_script("gen_options")


def test_options_doc_matches_the_code(gen_options):
    expected = gen_options.render()
    committed = gen_options.OUT.read_text() if gen_options.OUT.exists() else ""
    assert committed == expected, "docs/options.md is stale: run python scripts/gen_options.py"


def test_every_option_has_a_row(gen_options):
    from ardiff_policies.dreamzero.config import DreamZeroConfig
    from ardiff_server.config import EngineConfig, RayConfig, ServerConfig

    text = gen_options.render()
    for prefix, model in (("server", ServerConfig), ("engine", EngineConfig), ("ray", RayConfig), ("policy", DreamZeroConfig)):
        for name in model.model_fields:
            assert f"| `{prefix}.{name}` |" in text, f"{prefix}.{name} missing from docs/options.md"
    # the values people get wrong: the shipped configs' KV fraction differs from the default; hub ids are accepted
    assert "| `engine.kv_memory_fraction` | float | `0.5` |" in text
    assert "GEAR-Dreams/DreamZero-DROID" in text and "google/umt5-xxl" in text


def test_an_undocumented_option_is_refused(gen_options):
    class Undocumented(pydantic.BaseModel):
        documented: int = 1  # says what it does
        silent: int = 2

    with pytest.raises(SystemExit, match=r"Undocumented\.silent has neither a description nor a comment"):
        gen_options.rows("x", Undocumented)
