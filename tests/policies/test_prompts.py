"""DROID prompts exactly as upstream DreamZero tokenizes them.

``upstream_text`` below is written from upstream's code path (dreamzero0/dreamzero), step by step in upstream's
own terms, so each test pins both a hand-written expectation and agreement with that reading of upstream:

* socket_test_optimized_AR.py ``ARDroidRoboarenaPolicy._convert_observation``: a missing prompt is "";
* groot/vla/model/n1_5/sim_policy.py ``unsqueeze_dict_values``: the string becomes ``np.array([prompt])``;
* groot/vla/model/dreamzero/transform/dreamzero_cotrain.py ``DreamTransform._prepare_language`` (marker removal),
  ``collate`` (``ast.literal_eval`` + the OXE_DROID template with ``.lower()``), and
  ``HuggingfaceTokenizer(clean="whitespace")`` (``basic_clean``: ftfy + double html.unescape + strip;
  ``whitespace_clean``: ``regex`` ``\\s+`` -> " " + strip) right before the tokenizer.
"""

from __future__ import annotations

import ast
import html

import ftfy
import numpy as np
import pytest
import regex

from ardiff_policies.dreamzero.config import DEFAULT_NEGATIVE_PROMPT
from ardiff_policies.dreamzero.transforms import droid_instruction, droid_prompt
from ardiff_policies.wan.prompt import clean_prompt

MIDDLE = (
    " The video is split into three views: The top view shows the camera view from the robot's wrist, the bottom-left "
    "view shows the camera view from the left exterior camera, and the bottom-right view shows the camera view from the "
    "right exterior camera. During training, one of the two bottom exterior views may be a black screen (dropped view). "
    "The robot "
)
HEAD = "A multi-view video shows that a robot "


def upstream_text(prompt: str | None) -> str:
    """Upstream's server path for one DROID observation's prompt, up to the string handed to the tokenizer."""
    item = "" if prompt is None else prompt  # _convert_observation: absent key -> ""
    item = np.array([item])[0]  # unsqueeze_dict_values, then apply_batch's x[i]
    for marker in ("<LAPA>", "<DREAM>", "<COTRAIN>"):  # _prepare_language
        item = item.replace(marker, "")
    try:  # collate, OXE_DROID branch
        parsed = ast.literal_eval(item)
        processed = str(parsed[0]) if isinstance(parsed, (list, tuple)) else str(parsed)
        text = HEAD + processed.lower() + MIDDLE + processed.lower()
    except (ValueError, SyntaxError, TypeError):
        text = HEAD + str(item).lower() + MIDDLE + str(item).lower()
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()  # basic_clean
    return regex.sub(r"\s+", " ", text).strip()  # whitespace_clean


def expected(task: str) -> str:
    """The cleaned template around an already-clean, lower-case task ("" -> no task words)."""
    return regex.sub(r"\s+", " ", (HEAD + task + MIDDLE + task)).strip()


@pytest.mark.parametrize(
    ("prompt", "task"),
    [
        ("Put the Cup in the SINK.", "put the cup in the sink."),
        # HTML entities, once and twice escaped; lower-casing comes first, so "&AMP;" is "&amp;" by then
        ("cups &amp; plates", "cups & plates"),
        ("cups &amp;amp; plates", "cups & plates"),
        ("CUPS &AMP; PLATES", "cups & plates"),
        ("put it &lt;here&gt;", "put it <here>"),
        ("CAF&Eacute; MUG", "café mug"),
        # mojibake (UTF-8 read as cp1252) repaired by ftfy, which also straightens the curly quote
        ("donâ€™t drop it", "don't drop it"),
        ("â€œwipeâ€\x9d the table", '"wipe" the table'),
        # ... but lower-casing runs first, so mojibake with an upper-case letter ("Ã©" -> "ã©") stays broken
        ("pick up the cafÃ© mug", "pick up the cafã© mug"),
        ("pick up the café mug", "pick up the café mug"),
        # runs of whitespace, newlines, tabs, non-breaking spaces; the template's own spaces collapse too
        ("  pick\n\n up \t the\u00a0cup  ", "pick up the cup"),
        ("pick up\r\nthe cup", "pick up the cup"),
        # quoted literals in both quote styles, and a list literal (its first item)
        ("'Pick Up The Cup'", "pick up the cup"),
        ('"Pick Up The Cup"', "pick up the cup"),
        ("['Open the drawer', 'close it']", "open the drawer"),
        ("  'indented literal'", "indented literal"),  # literal_eval strips leading spaces and tabs
        # other literals are rendered by str()
        ("1e3", "1000.0"),
        ("None", "none"),
        # markers upstream removes from the instruction
        ("<COTRAIN>wipe the table", "wipe the table"),
        ("trailing nul\0\0", "trailing nul"),
    ],
)
def test_prompt_cases_match_upstream(prompt: str, task: str) -> None:
    assert droid_prompt(prompt) == expected(task) == upstream_text(prompt)


@pytest.mark.parametrize("prompt", ["", None, "   ", "\n\t ", "''", '""'])
def test_empty_prompts_are_an_empty_task_not_a_default_sentence(prompt: str | None) -> None:
    text = droid_prompt(prompt)
    assert text == upstream_text(prompt) == expected("")
    assert text.startswith("A multi-view video shows that a robot The video is split")
    assert text.endswith("(dropped view). The robot")
    assert "default behavior" not in text


def test_the_template_wraps_the_instruction_twice() -> None:
    text = droid_prompt("Stack The Blocks")
    assert text.startswith(HEAD + "stack the blocks The video is split into three views:")
    assert text.endswith("may be a black screen (dropped view). The robot stack the blocks")


def test_empty_list_literals_fail_like_upstream() -> None:
    for prompt in ("[]", "()"):
        with pytest.raises(ValueError, match="empty"):
            droid_instruction(prompt)
        with pytest.raises(IndexError):  # upstream's collate does not catch it
            upstream_text(prompt)


def test_control_characters_and_unicode_spaces() -> None:
    assert clean_prompt("a\x1cb\x0bc") == "abc"  # ftfy drops control characters before whitespace is collapsed
    assert clean_prompt("a\u2003\u3000\u2028b") == "a b"
    assert droid_prompt("pick\u2003up") == upstream_text("pick\u2003up") == expected("pick up")


def test_the_negative_prompt_is_cleaned_and_the_default_is_already_clean() -> None:
    assert clean_prompt(DEFAULT_NEGATIVE_PROMPT) == DEFAULT_NEGATIVE_PROMPT
    assert clean_prompt("  Vibrant &amp; colors,\n  overexposed ") == "Vibrant & colors, overexposed"
    assert clean_prompt("Vibrant Colors") == "Vibrant Colors"  # no lower-casing: that is the template's


def test_policy_refuses_an_empty_list_prompt_before_the_step(tiny_model) -> None:
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.dreamzero.config import DreamZeroConfig
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy
    from ardiff_policies.observation import RobotObservation, UnsupportedObservation

    policy = DreamZeroPolicy(DreamZeroConfig(view_size=(48, 80)), RuntimeOptions(), model=tiny_model)
    with pytest.raises(UnsupportedObservation, match="prompt"):
        policy.check_observation(RobotObservation(prompt="[]"))
    policy.check_observation(RobotObservation(prompt="'pick up'"))


def test_policy_encodes_the_cleaned_negative_prompt(tiny_model) -> None:
    import torch

    from ardiff_kv import Branch
    from ardiff_policies.base import RuntimeOptions
    from ardiff_policies.dreamzero.config import DreamZeroConfig
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy

    def negative(text: str) -> torch.Tensor:
        policy = DreamZeroPolicy(DreamZeroConfig(view_size=(48, 80), negative_prompt=text), RuntimeOptions(), model=tiny_model)

        class Session:
            prompt = "pick up"
            prompt_embeds = None

        return policy.inputs.prompt_embeds(Session(), policy.branches)[Branch.UNCOND]

    messy, clean = negative("  ugly &amp;   blurry\n"), negative("ugly & blurry")
    assert torch.equal(messy, clean)
    assert not torch.equal(clean, negative("ugly blurry"))
