"""The README's GPU recipes, checked as far as a CPU allows: each one's memory plan on the cards it names (the
plan the server prints and enforces at start-up, policies/dreamzero/memory.py), its device placement, and the
start-up refusals it can hit, which must name the exact fix. The commands are read from README.md itself."""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from ardiff_policies.dreamzero import memory
from ardiff_policies.wan.memory import GiB
from ardiff_server.config import ConfigError, load_config, preflight
from tests.helpers.scripts import load_script
from tests.helpers.server_harness import REPO

CONTEXT_GIB = 0.5  # the CUDA context (scripts/memory_plan.py)
README = (REPO / "README.md").read_text()


@pytest.fixture(scope="module")
def geometries() -> dict[str, memory.ModelGeometry]:
    memory_plan = load_script("memory_plan")
    return {"14B": memory_plan.geometry_14b(), "5B": memory_plan.geometry_5b()}


def recipe(marker: str) -> tuple[str, list[str]]:
    """(config, --set overrides) of the README command line that ends with ``# <marker>``."""
    lines = [line for line in README.splitlines() if line.startswith("bash scripts/serve.sh --gpu") and line.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, f"README.md has no single 'bash scripts/serve.sh --gpu ... # {marker}' line"
    args = shlex.split(lines[0].partition("#")[0])[3:]
    config, sets = "tiny", []
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--config":
            config = value
        elif flag == "--set":
            sets.append(value)
        else:
            assert flag == "--port", flag
            sets.append(f"server.port={value}")  # as ardiff-serve applies it
    return config, sets


def settings(config, rank: int = 0) -> memory.PlanSettings:
    """What a worker of rank ``rank`` plans with (as memory.check_plan builds it from the engine's options)."""
    engine, policy = config.engine, config.policy_options()
    device = engine.replica_device_lists()[0][rank]
    branches = (1 if engine.cfg_parallel_size == 2 else 2) if policy.cfg_scale != 1 else 1
    return memory.PlanSettings(
        engine_device=device,
        dtype=getattr(torch, engine.dtype),
        text_encoder_device=policy.text_encoder_device,
        image_encoder_device=policy.image_encoder_device,
        branches=branches,
        cfg_parallel_size=engine.cfg_parallel_size,
        max_sessions=engine.max_sessions,
        kv_budget_gib=engine.kv_budget_gib,
        kv_memory_fraction=engine.kv_memory_fraction,
        max_batch=engine.batch_limit,
    )


def plan_on(geometry, config, card_gib: float, *, rank: int = 0, used_gib: float = 0.0) -> memory.MemoryPlan:
    s = settings(config, rank)
    free = {s.engine_device: int((card_gib - CONTEXT_GIB - used_gib) * GiB), "cpu": 64 * GiB}
    return memory.plan_memory(geometry, s, free)


def test_droid_14b_on_one_80_gib_card(geometries):
    config = load_config(*recipe("one 80 GiB card"))
    assert config.engine.replica_device_lists() == [["cuda:0"]]
    plan = plan_on(geometries["14B"], config, 80)
    plan.check()
    assert plan.device("cuda:0").kv.sessions >= 1
    with pytest.raises(memory.MemoryPlanError, match=r"policy\.text_encoder_device=cpu"):  # the same on a 48 GiB card: refused, with the fix
        plan_on(geometries["14B"], config, 48).check()


def test_droid_14b_figures_the_readme_gives(geometries):
    """The README's one figure per config and card is the plan's: total, KV and sessions."""
    cases = {"one 80 GiB card": (80, 67.8, 20.6, 1), "one 80 GiB card, two sessions": (80, 73.1, 36.6, 2), "one 141 GiB card": (141, 132.5, 78.5, 4)}
    for marker, (card, total, kv, sessions) in cases.items():
        device = plan_on(geometries["14B"], load_config(*recipe(marker)), card).device("cuda:0")
        assert (round(device.total / GiB, 1), round(device.kv.pool_bytes / GiB, 1), device.kv.sessions) == (total, kv, sessions), marker
        assert f"{total} GiB" in README and f"KV {kv}" in README, marker


def test_cfg_parallel_on_two_80_gib_cards(geometries):
    config = load_config(*recipe("two 80 GiB cards, CFG-parallel"))
    assert config.engine.replica_device_lists() == [["cuda:0", "cuda:1"]]
    for rank in (0, 1):
        plan = plan_on(geometries["14B"], config, 80, rank=rank)
        plan.check()
        assert plan.settings.branches == 1 and plan.device(f"cuda:{rank}").kv.sessions >= 2


def test_the_5b_on_one_48_gib_card(geometries):
    config = load_config(*recipe("one 48 GiB card"))
    plan_on(geometries["5B"], config, 48).check()


def test_the_5b_on_one_24_gib_card_with_umt5_on_the_cpu(geometries):
    config_name, sets = recipe("one 24 GiB card, UMT5 on the CPU")
    plan = plan_on(geometries["5B"], load_config(config_name, sets), 24)
    plan.check()
    assert plan.device("cuda:0").kv.sessions >= 4 and "text_encoder" in plan.device("cpu").weights
    # without the recipe's two settings the start-up refusal names them
    bare = [s for s in sets if not s.startswith(("policy.text_encoder_device", "engine.kv_memory_fraction"))]
    with pytest.raises(memory.MemoryPlanError) as caught:
        plan_on(geometries["5B"], load_config(config_name, bare), 24).check()
    assert "policy.text_encoder_device=cpu" in str(caught.value) and "engine.kv_memory_fraction=" in str(caught.value)


def test_two_models_on_one_80_gib_card_with_kv_budgets(geometries):
    first = load_config(*recipe("two models on one 80 GiB card: the first"))
    second = load_config(*recipe("two models on one 80 GiB card: the second"))
    assert first.server.port != second.server.port
    assert first.engine.kv_budget_gib and second.engine.kv_budget_gib
    one = plan_on(geometries["5B"], first, 80)
    one.check()
    two = plan_on(geometries["5B"], second, 80, used_gib=one.device("cuda:0").total / GiB)  # what the first holds
    two.check()
    # without a budget the fraction buys no more than engine.max_sessions sessions fill: a default first server leaves room
    default = plan_on(geometries["5B"], load_config("dreamzero_droid_5b"), 80)
    assert default.device("cuda:0").kv.sessions == default.settings.max_sessions
    plan_on(geometries["5B"], second, 80, used_gib=default.device("cuda:0").total / GiB).check()
    # one allowed many more sessions takes kv_memory_fraction of everything its weights leave, and the second cannot start
    greedy = plan_on(geometries["5B"], load_config("dreamzero_droid_5b", ["engine.max_sessions=256"]), 80)
    with pytest.raises(memory.MemoryPlanError):
        plan_on(geometries["5B"], second, 80, used_gib=greedy.device("cuda:0").total / GiB).check()


def test_replicas_of_the_cfg2_config_take_two_gpus_each(geometries):
    config = load_config(*recipe("two CFG-parallel replicas on four 80 GiB cards"))
    assert config.engine.replica_device_lists() == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    for rank in (0, 1):
        plan_on(geometries["14B"], config, 80, rank=rank).check()
    # the refusal without the recipe's engine.devices=null names that fix and a replica_devices list of pairs
    with pytest.raises(ValueError) as caught:
        load_config("dreamzero_droid_cfg2", ["engine.replicas=2"]).engine.replica_device_lists()
    message = str(caught.value)
    assert "--set engine.devices=null" in message and "engine.replica_devices=[[cuda:0,cuda:1], [cuda:2,cuda:3], ...]" in message
    assert "set engine.device: cuda" not in message  # it already is


@pytest.mark.parametrize("name", ["dreamzero_droid", "dreamzero_droid_cfg2", "dreamzero_droid_5b"])
def test_on_a_machine_without_cuda_the_refusal_names_a_fix_that_works(monkeypatch, name):
    monkeypatch.setattr("ardiff_server.config.cuda_device_count", lambda: 0)
    with pytest.raises(ConfigError) as caught:
        preflight(load_config(name))
    message = str(caught.value)
    assert "\n" not in message and "no CUDA device" in message
    fix = re.findall(r"--set (\S+)", message.partition("or --set")[1] and "--set" + message.partition("or --set")[2])
    fixed = load_config(name, fix)
    assert {d for devices in fixed.engine.replica_device_lists() for d in devices} == {"cpu"}, fix
