"""scripts/gpu_check.py on CPU: the device run's code path at reduced size, and its wheel list."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.fixture(scope="module")
def reduced_run(gpu_check, tmp_path_factory):
    """One reduced run: the reference, a compiled flex variant, and a CUDA-graph variant (skipped)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("gpu_check")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report = gpu_check.main(
            ["--json", "--variants", "sdpa,flex+compile,flex+graphs", "--batches", "1,2", "--batch-calls", "2", "--out", str(out)]
        )
    return report, stdout.getvalue(), out


def test_reduced_run_reports_every_figure_the_device_run_reports(reduced_run):
    report, text, out = reduced_run
    assert report["size"] == "reduced" and report["device"] == "cpu" and report["checkpoint"] == "synthetic:tiny,layers=2"
    assert set(report["variants"]) == {"sdpa", "flex+compile"}
    assert report["skipped"] == {"flex+graphs": "CUDA graphs need a CUDA device"}
    for result in report["variants"].values():
        assert result["status"] == "ok", result.get("traceback")
        assert len(result["calls"]) == 6  # a full window (1 + 4 calls) and a window restart
        starts = [c["window_start"] for c in result["calls"]]
        assert starts == [True, False, False, False, True, False]
        assert all(c["dit_forwards"] == 8 for c in result["calls"])  # upstream's fixed 8-of-16 mask
        for group in ("window_start", "steady"):
            assert set(result["phase_ms"][group]) >= {"text", "vision", "vae", "prefill", "denoise", "decode"}
        assert result["phase_ms"]["window_start"]["vision"] > 1.0 > result["phase_ms"]["steady"]["vision"]  # CLIP at a window start only
        assert result["ms_per_chunk_p99"] >= result["ms_per_chunk_median"] > 0
        assert result["dit_fraction_of_peak"] > 0 and result["actions_finite"]
        kv = result["kv"]
        assert kv["reserved_pages_per_session"] == 22 and kv["pool_pages"] == 22  # 2 branches x (9 + 2), one session
        assert kv["max_pages_held"] == 14 and kv["page_tokens"] == 60  # 7 resident frames + the 2-frame prefill, x 2
    assert report["variants"]["flex+compile"]["vs_reference"]["ok"]
    assert report["variants"]["flex+compile"]["compile"] and report["variants"]["flex+compile"]["backend"] == "flex"
    assert report["flops"]["compute_bound_ms"] > 0 and report["anchors"]["vllm_omni_ms_one_h200"] == 1095.0
    # the server's memory plan beside it: its weights (meta-device counts) are what was materialized
    plan = report["memory_plan_gib"]
    assert plan["weights"] == pytest.approx(sum(report["weights_gib"].values()), abs=1e-3) and plan["total"] > plan["weights"] + plan["kv"]

    # several robots per engine step: a window start then a steady call, for 1 and 2 sessions
    rows = report["batches"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["status"] == "ok" and r["chunks_per_s"] > 0 for r in rows)
    assert rows[0]["speedup_vs_batch_1"] == 1.0

    # the printed tables, the anchors, and the JSON line last
    for needle in (
        "phase (mean ms)",
        "summary",
        "compute bound",
        "vLLM-Omni 1095 ms/chunk",
        "62.2 GiB/GPU",
        "skipped: CUDA graphs",
        "several robots per GPU",
    ):
        assert needle in text, needle
    last = json.loads(text.strip().splitlines()[-1])
    assert last["variants"]["sdpa"]["ms_per_chunk_median"] == report["variants"]["sdpa"]["ms_per_chunk_median"]
    assert "actions" not in last["variants"]["sdpa"]  # bulky arrays only in the file
    saved = json.loads((out / "gpu_check.json").read_text())
    assert len(saved["variants"]["sdpa"]["actions"]) == 6


def test_budget_stops_measuring_and_skips_later_variants(gpu_check, capsys, monkeypatch):
    build = gpu_check.build_variant_engine

    def build_without_warmup(*args):
        engine = build(*args)
        engine.warmup = lambda: {}  # only the budget logic is under test here
        return engine

    monkeypatch.setattr(gpu_check, "build_variant_engine", build_without_warmup)
    report = gpu_check.main(["--variants", "sdpa,flex", "--calls", "3", "--budget-s", "0.001"])
    sdpa = report["variants"]["sdpa"]
    assert sdpa["status"] == "ok" and len(sdpa["calls"]) == 1 and "time budget" in sdpa["partial"]
    assert report["skipped"]["flex"].startswith("time budget") and report["skipped"]["batches"].startswith("time budget")
    assert "PARTIAL" in capsys.readouterr().out


def test_wheels_are_only_installed_when_something_is_missing(gpu_check, monkeypatch, tmp_path):
    assert gpu_check.ensure_wheels(tmp_path) == []  # this venv has everything
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("surely_not_installed_module",))
    with pytest.raises(SystemExit, match=r"fetch_device_wheels\.sh"):
        gpu_check.ensure_wheels(tmp_path)


def test_fetch_script_covers_every_module_the_import_chain_needs(gpu_check):
    script = (ROOT / "scripts" / "fetch_device_wheels.sh").read_text()
    listed = {name.replace("-", "_") for name in re.findall(r'^\s+"([a-z0-9-]+) \$\(version', script, re.M)}
    assert set(gpu_check.NEEDED_MODULES) <= listed
    assert "torch" not in listed and "vllm" not in listed  # 64 MiB per device call, wheels included
    assert "--python-version 3.12" in script


def test_variant_names(gpu_check):
    v = gpu_check.Variant("flex+compile+graphs")
    assert (v.backend, v.compile, v.graphs) == ("flex", True, True)
    with pytest.raises(SystemExit):
        gpu_check.Variant("magic+turbo")


def test_percentile(gpu_check):
    assert gpu_check.percentile([1, 2, 3, 4], 50) == 2.5
    assert gpu_check.percentile([5.0], 99) == 5.0


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_fetch_script_is_valid_bash():
    import subprocess

    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "fetch_device_wheels.sh")], check=True)


def test_lingbot_va_family_runs_episodes_and_batches_at_reduced_size(gpu_check):
    """``--family lingbot_va``: the device run's LingBot-VA path (synthetic:released there) at reduced size."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        report = gpu_check.main(["--family", "lingbot_va", "--calls", "3", "--batches", "2"])
    assert report["family"] == "lingbot_va" and report["checkpoint"] == "synthetic:tiny" and report["embodiment"] == "tiny_robotwin"
    assert len(report["episode"]["calls_ms"]) == 3 and all(ms > 0 for ms in report["episode"]["calls_ms"])
    assert report["batches"][2]["chunks_per_s"] > 0
    assert "memory_plan_gib" not in report  # the plan models the released networks only


def test_lingbot_va_synthetic_released_spec_is_the_5b():
    from ardiff_policies.lingbot_va.synthetic import parse_spec

    spec = parse_spec("synthetic:released,layers=2")
    assert (spec.transformer.num_layers, spec.transformer.dim, spec.transformer.ffn_dim, spec.text["d_model"]) == (2, 3072, 14336, 4096)
    with pytest.raises(ValueError, match="layers=31"):
        parse_spec("synthetic:released,layers=31")


def test_zero_wam_family_runs_episodes_with_a_pinned_demonstration_and_batches_at_reduced_size(gpu_check):
    """``--family zero_wam``: the device run's Zero-WAM path (synthetic:released there, a 32-frame demonstration pinned)
    at reduced size: every episode in-context guided, batches of sessions."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        report = gpu_check.main(["--family", "zero_wam", "--calls", "3", "--batches", "2"])
    assert report["family"] == "zero_wam" and report["checkpoint"] == "synthetic:tiny" and report["embodiment"] == "tiny_robotwin"
    assert report["guidance"] == ["in-context"]
    assert len(report["episode"]["calls_ms"]) == 3 and report["batches"][2]["chunks_per_s"] > 0
    assert "memory_plan_gib" not in report  # the plan models the released networks only


def test_zero_wams_full_size_run_is_planned_from_the_served_spec(gpu_check):
    """What the device run would reserve and hold its peak against, without building the model: the released
    transformer's served spec, a 32-frame demonstration at 20x30 pinned, the plan of the released networks."""
    import argparse

    import torch

    from ardiff_policies.lingbot_va.synthetic import parse_spec

    args = argparse.Namespace(checkpoint="synthetic:released")
    budget, plan, section, first = gpu_check.zero_wam_setup(args, "robotwin", parse_spec("synthetic:released"), torch.bfloat16, 2, 2)
    assert section["name"] == "zero_wam" and first.start.demonstration_id == "bound"
    latent = torch.load(f"{section['demonstration_root']}/bound.pth", weights_only=True)["latent"]
    assert tuple(latent.shape) == (1, 48, 32, 20, 30)
    assert 2 * plan.kv_session / 2**30 < budget < 2 * plan.kv_session / 2**30 + 3  # two sessions, scratch and undo room
