"""Zero-WAM's per-episode guidance decision (ardiff_policies.lingbot_va.zero_wam_guidance): upstream's _reset_icl."""

from __future__ import annotations

import re

import pytest

from ardiff_policies.lingbot_va.zero_wam_guidance import GuidanceMode, plan_guidance


def test_upstreams_default_is_in_context_guidance_on_an_empty_target_text():
    plan = plan_guidance(use_icl=True, video_guidance_scale=-1, icl_guidance_scale=5)  # TARGET_TEXT_CFG -1, ICL_CFG 5
    assert plan.mode is GuidanceMode.IN_CONTEXT and plan.scale == 5.0 and plan.halves == 2
    assert plan.target_text_empty and plan.uncond_text_empty  # both halves the (empty) target text


def test_in_context_guidance_takes_precedence_over_text_guidance():
    plan = plan_guidance(use_icl=True, video_guidance_scale=4, icl_guidance_scale=3)
    assert (plan.mode, plan.scale, plan.target_text_empty, plan.uncond_text_empty) == (GuidanceMode.IN_CONTEXT, 3.0, False, False)


def test_text_guidance_without_a_demonstration_or_with_icl_scale_one():
    for use_icl, icl in ((False, 5), (True, 1)):
        plan = plan_guidance(use_icl=use_icl, video_guidance_scale=5, icl_guidance_scale=icl)
        assert (plan.mode, plan.scale, plan.demonstration, plan.uncond_text_empty) == (GuidanceMode.TEXT, 5.0, use_icl, True)


def test_no_guidance_one_half():
    plan = plan_guidance(use_icl=True, video_guidance_scale=-1, icl_guidance_scale=1)
    assert (plan.mode, plan.halves, plan.demonstration, plan.uncond_text_empty) == (GuidanceMode.NONE, 1, True, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_icl": 1}, "use_icl: expected true or false, got 1"),
        ({"video_guidance_scale": "5"}, "video_guidance_scale: expected a number, got '5'"),
        ({"icl_guidance_scale": float("nan")}, "icl_guidance_scale: expected a number"),
        ({"icl_guidance_scale": -1}, "icl_guidance_scale: -1 outside [0, 20]"),
        ({"video_guidance_scale": 50}, "video_guidance_scale: 50 outside [-20, 20]"),
    ],
)
def test_a_bad_key_is_named(kwargs, message):
    from ardiff_policies.lingbot_va.episode import EpisodeError

    with pytest.raises(EpisodeError, match=re.escape(message)):
        plan_guidance(**({"use_icl": True, "video_guidance_scale": -1, "icl_guidance_scale": 5} | kwargs))
