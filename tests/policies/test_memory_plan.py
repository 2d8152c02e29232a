"""The memory plan: exact weights, the KV pool the engine really allocates, the refusal line, placement options."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import numpy as np
import pydantic
import pytest
import torch
from safetensors import safe_open

from ardiff_kv import PagedKVCache
from ardiff_policies.base import RuntimeOptions
from ardiff_policies.dreamzero import memory
from ardiff_policies.dreamzero.config import DreamZeroConfig
from ardiff_policies.dreamzero.naming import DIT_PREFIX, IMAGE_ENCODER_PREFIX, TEXT_ENCODER_PREFIX, VAE_PREFIX
from ardiff_policies.dreamzero.tiny import TINY_VIEW_SIZE, ensure_tiny_checkpoint
from ardiff_policies.wan.memory import GiB
from tests.helpers.reference import REFERENCE_DIR
from tests.helpers.scripts import load_script

REFERENCE_TENSORS = REFERENCE_DIR / "dreamzero_droid_tensors.json"
PREFIXES = {"dit": DIT_PREFIX, "text_encoder": TEXT_ENCODER_PREFIX, "image_encoder": IMAGE_ENCODER_PREFIX, "vae": VAE_PREFIX}


@pytest.fixture(scope="module")
def droid() -> memory.ModelGeometry:
    return memory.synthetic_geometry("synthetic:droid")


@pytest.fixture(scope="module")
def tiny() -> memory.ModelGeometry:
    return memory.checkpoint_geometry(ensure_tiny_checkpoint(), TINY_VIEW_SIZE)


def plan(geometry, free_gib: float | None = None, cpu_gib: float = 256, **settings) -> memory.MemoryPlan:
    settings = {"engine_device": "cuda:0", "dtype": torch.bfloat16, **settings}
    free = None if free_gib is None else {settings["engine_device"]: int(free_gib * GiB), "cpu": int(cpu_gib * GiB)}
    return memory.plan_memory(geometry, memory.PlanSettings(**settings), free)


# ------------------------------------------------------------------------------ weights and KV


def test_tiny_weights_are_the_checkpoints_tensors(tiny):
    """Meta-device counts == the element counts stored in the checkpoint, per component."""
    ckpt = ensure_tiny_checkpoint()
    stored = dict.fromkeys(PREFIXES, 0)
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle
                component = next(c for c, prefix in PREFIXES.items() if name.startswith(prefix))
                stored[component] += math.prod(f.get_slice(name).get_shape())
    assert {c: s.floating for c, s in tiny.sizes.items()} == stored
    assert tiny.sizes["image_encoder"].other_bytes == 257 * 8  # CLIP's int64 position ids (224 px / 14 px patches + class token)


@pytest.mark.skipif(not REFERENCE_TENSORS.exists(), reason=f"released checkpoint tensor list not found at {REFERENCE_TENSORS}")
def test_14b_weights_are_the_released_tensors(droid):
    released = dict.fromkeys(PREFIXES, 0)
    for name, (shape, _) in json.loads(REFERENCE_TENSORS.read_text())["tensors"].items():
        released[next(c for c, prefix in PREFIXES.items() if name.startswith(prefix))] += math.prod(shape)
    assert {c: s.floating for c, s in droid.sizes.items()} == released
    bf16 = plan(droid).device("cuda:0").weights
    assert round(sum(bf16.values()) / GiB, 2) == 42.70  # DiT 30.70 + UMT5 10.58 + CLIP 1.18 + VAE 0.24 (docs/performance.md)


def test_kv_pool_is_what_the_engine_allocates(tiny):
    """The plan's pool bytes == a real PagedKVCache's storage, sized the engine's way, for a few budgets
    and batch sizes (each session of a batch has its own scratch pages)."""
    from ardiff_kv import Branch

    for branches, budget_gib, sessions, batch in ((2, 0.25, 8, 1), (1, 0.05, 3, 1), (2, 0.0, 1, 1), (2, 0.25, 8, 4)):
        p = plan(
            tiny,
            engine_device="cpu",
            dtype=torch.float32,
            branches=branches,
            max_sessions=sessions,
            kv_budget_gib=budget_gib or None,
            max_batch=batch,
        )
        kv = p.device("cpu").kv
        pages = PagedKVCache.pages_for_budget(kv.spec, int(budget_gib * GiB), max_sessions=sessions, num_branches=branches, max_batch=batch)
        assert kv.pages == pages
        cache = PagedKVCache(kv.spec, num_pages=pages + 1, max_sessions=sessions, branches=(Branch.COND, Branch.UNCOND)[:branches], max_batch=batch)
        assert cache.storage.nbytes == kv.pool_bytes
        assert kv.session_pages == cache.reservation_per_session


def test_the_plans_pool_is_the_engines_allocation_when_the_pool_holds_fewer_than_max_sessions(tiny):
    """The engine's path (ardiff_kv.kv_budget_bytes from what the weights leave free, then
    PagedKVCache.from_budget) against the plan: the same bytes of tensors, cross-attention slots
    for the sessions the pool holds (3 of max_sessions 8), and no page that no session could use."""
    from ardiff_kv import Branch, kv_budget_bytes

    free = {"cpu": 0}
    for branches, batch in ((2, 1), (1, 1), (2, 2)):
        settings = memory.PlanSettings(engine_device="cpu", dtype=torch.float32, branches=branches, max_sessions=8, max_batch=batch)
        spec = memory.dit_kv_spec(tiny.dit, torch.float32)
        weights = sum(size.bytes(torch.float32) for size in tiny.sizes.values())
        session = branches * (spec.pages_per_branch * spec.page_bytes + spec.cross_slot_bytes)
        scratch = batch * branches * spec.scratch_pages_per_branch * spec.page_bytes
        free["cpu"] = weights + 2 * (scratch + 3 * session + session // 2)  # fraction 0.5: 3.5 sessions' worth
        kv = memory.plan_memory(tiny, settings, free).device("cpu").kv
        budget = kv_budget_bytes(None, settings.kv_memory_fraction, free["cpu"] - weights)
        cache = PagedKVCache.from_budget(spec, budget, max_sessions=8, branches=(Branch.COND, Branch.UNCOND)[:branches], max_batch=batch)
        assert cache.session_capacity == kv.sessions == 3 and cache.storage.max_batch == kv.max_batch == batch
        assert cache.storage.cross.num_slots == 3 * branches  # not 8 x branches
        assert cache.storage.nbytes == kv.pool_bytes <= budget
        assert cache.pool.capacity == 3 * cache.reservation_per_session  # every page can back a session


def test_a_fraction_of_a_big_device_buys_only_what_max_sessions_can_fill(tiny):
    """kv_memory_fraction of a device far bigger than max_sessions need: the engine's pool and the
    plan's are those sessions' pages, cross slots and scratch (not 4140 pages where 176 are used);
    an explicit engine.kv_budget_gib is still bought as asked."""
    from ardiff_kv import Branch, kv_budget_bytes

    spec = memory.dit_kv_spec(tiny.dit, torch.float32)
    settings = memory.PlanSettings(engine_device="cpu", dtype=torch.float32, branches=2, max_sessions=4, max_batch=2)
    weights = sum(size.bytes(torch.float32) for size in tiny.sizes.values())
    free = {"cpu": weights + 64 * 2**30}
    kv = memory.plan_memory(tiny, settings, free).device("cpu").kv
    most = PagedKVCache.bytes_for_sessions(spec, max_sessions=4, num_branches=2, max_batch=2)
    budget = kv_budget_bytes(None, settings.kv_memory_fraction, free["cpu"] - weights, most=most)
    assert budget == most
    cache = PagedKVCache.from_budget(spec, budget, max_sessions=4, branches=(Branch.COND, Branch.UNCOND), max_batch=2)
    assert cache.pool.capacity == 4 * cache.reservation_per_session == kv.sessions * cache.reservation_per_session
    assert cache.storage.nbytes == kv.pool_bytes and cache.storage.max_batch == kv.max_batch == 2
    assert kv_budget_bytes(3.0, settings.kv_memory_fraction, 0, most=most) == 3 * 2**30


def test_14b_on_80_gib_buys_no_cross_slots_its_pool_cannot_use(droid):
    """The issue's case: engine.max_sessions 8 on an 80 GiB card, where the pool holds 1 or 2 sessions.
    The pool is its sessions' pages and cross slots plus scratch and the null page, nothing more."""
    for fraction in (0.5, 0.9, 0.95):
        kv = plan(droid, free_gib=79.5, max_sessions=8, kv_memory_fraction=fraction, text_encoder_device="cpu").device("cuda:0").kv
        overhead = (1 + kv.spec.scratch_pages_per_branch * kv.branches) * kv.spec.page_bytes
        assert kv.sessions < 8 and kv.pool_bytes == kv.sessions * kv.session_bytes + overhead


def test_dit_activations_count_every_cfg_branch_of_every_session_in_a_batch(droid):
    """One DiT forward holds a sequence per session x local CFG branch (2k on one GPU, k per rank
    under CFG-parallel); a VAE encode holds each session once."""
    small_canvas = dataclasses.replace(droid, canvas=(32, 64))  # a VAE phase smaller than the DiT's
    phases = memory.activation_bytes(small_canvas, torch.bfloat16)
    for branches, batch in ((2, 1), (1, 1), (2, 3), (1, 3)):
        p = plan(
            small_canvas,
            max_sessions=4,
            max_batch=batch,
            kv_budget_gib=200.0,
            branches=branches,
            text_encoder_device="cpu",
            image_encoder_device="cpu",
        )
        assert phases["dit"] * branches * batch > phases["vae"] * batch
        assert p.device("cuda:0").activations == phases["dit"] * branches * batch


def test_the_cuda_reserve_is_printed_as_unmeasured(droid):
    described = plan(droid, free_gib=48, max_sessions=1).describe()
    assert re.search(r"CUDA reserve +1\.00 GiB +\(unmeasured", described), described
    with pytest.raises(memory.MemoryPlanError, match=r"\+ unmeasured reserve 1\.0 GiB"):
        plan(droid, free_gib=48, max_sessions=1).check()


def test_14b_kv_numbers(droid):
    kv = plan(droid, max_sessions=1).device("cuda:0").kv
    assert kv.spec.page_bytes == 880 * 40 * 2 * 5120 * 2  # 687.5 MiB: one latent frame, K and V, every layer
    assert kv.session_pages == 22 and kv.pages == 22  # 2 branches x (9-frame window + 2 in flight); the floor
    assert round(kv.pool_bytes / GiB, 2) == 20.64  # + 6 scratch + null page + 2 cross slots of 769 tokens
    assert plan(droid, max_sessions=1, branches=1, cfg_parallel_size=2).device("cuda:0").kv.session_pages == 11


def test_a_fraction_budget_is_sized_from_what_the_weights_leave(droid):
    p = plan(droid, free_gib=141, kv_memory_fraction=0.9, max_sessions=4)
    gpu = p.device("cuda:0")
    left = 141 * GiB - sum(gpu.weights.values())
    assert gpu.kv.pool_bytes <= 0.9 * left + gpu.kv.spec.page_bytes * (1 + 6) and gpu.kv.sessions == 4
    assert gpu.total <= 141 * GiB and not p.shortfalls()


def test_activation_estimate_orders_the_phases(droid, tiny):
    phases = memory.activation_bytes(droid, torch.bfloat16)
    assert phases["vae"] > phases["dit"] > phases["text_encoder"] > phases["image_encoder"] > 0
    # the 352x640 VAE chunk: 7 x 96 channels x 6 frames x 352 x 640 x 4 bytes + the 33-frame input
    assert phases["vae"] == 7 * 96 * 6 * 352 * 640 * 4 + 3 * 33 * 352 * 640 * 2
    assert phases["vae"] > 3363 * 2**20  # measured: a 9-frame float32 encode at 352x640 peaks at 3363 MiB of tensors
    assert memory.activation_bytes(tiny, torch.float32)["vae"] < 64 * 2**20


# ------------------------------------------------------------------------------ placement and refusal


def test_placement_moves_encoder_weights_and_activations_off_the_gpu(droid):
    p = plan(droid, free_gib=80, text_encoder_device="cpu", image_encoder_device="cpu")
    gpu, cpu = p.device("cuda:0"), p.device("cpu")
    assert set(gpu.weights) == {"dit", "vae"} and set(cpu.weights) == {"text_encoder", "image_encoder"}
    assert cpu.kv is None and cpu.reserve == 0 and gpu.kv is not None
    assert cpu.activations == memory.activation_bytes(droid, torch.bfloat16)["text_encoder"]
    assert p.settings.device_of("text_encoder") == "cpu" and plan(droid, text_encoder_device="cuda:1").settings.device_of("text_encoder") == "cuda:1"
    assert memory.resolve_device("cuda", "cpu") == "cuda:0" and memory.resolve_device("cuda", "cuda:3") == "cuda:3"


@pytest.mark.parametrize(
    ("free_gib", "settings", "needle"),
    [
        # 14B, both branches, UMT5 and CLIP on the GPU, one session: 67.8 GiB
        (48, {"max_sessions": 1}, "needs 67.8 GiB on cuda:0, has 48.0 GiB free"),
        (48, {"max_sessions": 1}, "set policy.text_encoder_device=cpu and engine.cfg_parallel_size=2 with engine.devices=[cuda:0,cuda:1]"),
        (
            47,
            {"max_sessions": 1},
            "set policy.text_encoder_device=cpu, policy.image_encoder_device=cpu and engine.cfg_parallel_size=2 with engine.devices=[cuda:0,cuda:1]",
        ),
        (62, {"max_sessions": 1}, "set policy.text_encoder_device=cpu or engine.cfg_parallel_size=2 with engine.devices=[cuda:0,cuda:1]"),
        (24, {"max_sessions": 1}, "even with every placement option it needs 46.0 GiB on cuda:0: use a device with more memory"),
        (80, {"kv_memory_fraction": 1.0, "max_sessions": 8}, "set engine.kv_memory_fraction=0.96"),
        (80, {"kv_budget_gib": 60.0}, "set engine.kv_budget_gib=3"),
    ],
)
def test_a_plan_that_does_not_fit_is_refused_in_one_line_with_the_fix(droid, free_gib, settings, needle):
    p = plan(droid, free_gib=free_gib, **settings)
    with pytest.raises(memory.MemoryPlanError) as caught:
        p.check()
    message = str(caught.value)
    assert needle in message and "\n" not in message, message
    assert "DOES NOT FIT" in p.describe()


def test_the_host_holds_the_cpu_encoders_of_every_cfg_rank(droid, monkeypatch):
    """CFG-parallel: both ranks put UMT5 on the CPU, and both start at once, so each seeing the host's
    free memory alone would let two 10.6 GiB encoders into 16 GiB. Rank 0 checks the host for both;
    rank 1 checks its own GPU only (it would count rank 0's encoder twice once rank 0 has loaded it)."""
    from ardiff_policies.guidance import Guidance

    settings = {"max_sessions": 1, "branches": 1, "cfg_parallel_size": 2, "text_encoder_device": "cpu"}
    one = plan(droid, free_gib=79.5, cpu_gib=256, **settings).device("cpu")
    both = plan(droid, free_gib=79.5, cpu_gib=256, host_processes=2, **settings).device("cpu")
    assert both.total == 2 * one.total and 1.2 * one.total < 16 * GiB < both.total
    monkeypatch.setattr(memory, "check_devices_exist", lambda devices, count: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 16 * GiB if device == "cpu" else int(79.5 * GiB))
    config = DreamZeroConfig(text_encoder_device="cpu")
    for rank in (0, 1):
        options = RuntimeOptions(device=f"cuda:{rank}", dtype="bfloat16", guidance=Guidance.parallel(rank), max_sessions=1, max_batch=1)
        if rank == 0:
            with pytest.raises(memory.MemoryPlanError, match=r"on cpu, has 16\.0 GiB free \(.* GiB for each of 2 CFG ranks\)"):
                memory.check_plan(droid, config, options, torch.device("cuda", 0))
        else:
            memory.check_plan(droid, config, options, torch.device("cuda", 1))  # the host is rank 0's to check


def test_the_suggested_fix_fits(droid):
    """Applying the suggestion gives a plan the same device accepts."""
    refused = plan(droid, free_gib=62, max_sessions=1)
    assert memory.suggest_fix(refused) == "set policy.text_encoder_device=cpu or engine.cfg_parallel_size=2 with engine.devices=[cuda:0,cuda:1]"
    plan(droid, free_gib=62, max_sessions=1, text_encoder_device="cpu").check()
    plan(droid, free_gib=62, max_sessions=1, branches=1, cfg_parallel_size=2).check()
    with pytest.raises(memory.MemoryPlanError, match="on cpu"):  # the host must hold what moves there
        plan(droid, free_gib=62, cpu_gib=4, max_sessions=1, text_encoder_device="cpu").check()


def test_the_5b_fits_one_24_gib_card_with_umt5_on_the_cpu():
    memory_plan = load_script("memory_plan")
    geometry = memory_plan.geometry_5b()
    assert geometry.dit.frame_seqlen == 50 and geometry.vae["z_dim"] == 48 and geometry.canvas == (160, 320)
    assert 5.5e9 < geometry.sizes["dit"].floating < 5.7e9  # Wan2.2-TI2V-5B plus the I2V image K/V and the action register
    free = 23.5  # a 24 GiB card less the CUDA context
    with pytest.raises(memory.MemoryPlanError, match=re.escape("set policy.text_encoder_device=cpu")):
        plan(geometry, free_gib=free, max_sessions=1).check()
    plan(geometry, free_gib=free, max_sessions=4, text_encoder_device="cpu").check()


def test_the_docs_table_rows():
    rows = {(r.model, r.gpus, r.text, r.image): r for r in load_script("memory_plan").rows()}
    assert len(rows) == 12
    assert rows[("14B", 1, "GPU", "GPU")].sessions == {24: 0, 48: 0, 80: 1, 141: 5}
    assert rows[("14B", 2, "CPU", "CPU")].sessions[48] == 1  # CFG-parallel on two 48 GiB cards, encoders on the CPU
    assert all(r.sessions[24] == 0 for r in rows.values() if r.model == "14B")
    assert rows[("5B", 1, "CPU", "GPU")].sessions[24] > 0 and rows[("5B", 1, "GPU", "GPU")].sessions[24] == 0
    for r in rows.values():
        assert math.isclose(r.total, r.weights + r.kv + r.activations + r.reserve, abs_tol=1e-6)


def test_a_missing_placement_gpu_is_named():
    with pytest.raises(memory.MemoryPlanError, match="cuda:1: this machine has 1 CUDA device"):
        memory.check_devices_exist(["cpu", "cuda:0", "cuda:1"], cuda_count=1)
    memory.check_devices_exist(["cpu"], cuda_count=0)


def test_placement_settings_are_validated():
    assert DreamZeroConfig(text_encoder_device="cpu", image_encoder_device="cuda:1").text_encoder_device == "cpu"
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "engine "):
        with pytest.raises(pydantic.ValidationError, match="expected engine, cpu, cuda or cuda:<index>"):
            DreamZeroConfig(text_encoder_device=bad)


def test_free_memory_is_read_per_device():
    assert memory.free_bytes("cpu") == memory.host_available_bytes() or memory.free_bytes("cpu") > 0
    if torch.cuda.is_available():
        assert 0 < memory.free_bytes("cuda:0") <= torch.cuda.get_device_properties(0).total_memory


# ------------------------------------------------------------------------------ the policy


def test_the_policy_refuses_before_loading_a_weight(monkeypatch):
    """A plan that does not fit stops the policy before the checkpoint is read (free memory injected)."""
    from ardiff_policies.dreamzero.model import DreamZeroModel
    from ardiff_policies.dreamzero.policy import DreamZeroPolicy

    loads = []
    monkeypatch.setattr(DreamZeroModel, "load", classmethod(lambda cls, *a, **k: loads.append(a) or pytest.fail("loaded weights")))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 64 * 2**20)
    config = DreamZeroConfig(view_size=TINY_VIEW_SIZE)
    with pytest.raises(memory.MemoryPlanError, match=r"needs 1\.\d GiB on cpu, has 0\.1 GiB free .*set engine.kv_budget_gib=0"):
        DreamZeroPolicy(config, RuntimeOptions(kv_budget_gib=1.0))
    assert not loads


class ElsewhereEncoder(torch.nn.Module):
    """An encoder whose outputs come back in float64, as from a device and precision that are not the DiT's."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self.inner(*args).double()


def test_encoder_outputs_are_moved_to_the_dits_device_and_dtype(tiny_model):
    from tests.helpers.dreamzero import make_policy, observations, rollout

    _, reference = rollout(*make_policy(tiny_model), observations(5))
    elsewhere = dataclasses.replace(
        tiny_model, text_encoder=ElsewhereEncoder(tiny_model.text_encoder), image_encoder=ElsewhereEncoder(tiny_model.image_encoder)
    )
    policy, cache = make_policy(elsewhere, text_encoder_device="cpu", image_encoder_device="cpu")
    assert policy.text_device == policy.image_device == torch.device("cpu")
    _, moved = rollout(policy, cache, observations(5))
    assert elsewhere.text_encoder.calls == 2 and elsewhere.image_encoder.calls == 2  # prompt + negative once; 2 window starts
    for a, b in zip(reference, moved):
        np.testing.assert_array_equal(b.actions, a.actions)  # float32 -> float64 -> float32 is exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the encoders on the CPU, the DiT on the GPU")
def test_encoders_on_the_cpu_serve_a_cuda_engine(tiny_checkpoint):
    from ardiff_policies.dreamzero.model import DreamZeroModel
    from tests.helpers.dreamzero import observations

    def actions(**placement):
        from ardiff_policies.dreamzero.policy import DreamZeroPolicy

        model = DreamZeroModel.load(tiny_checkpoint, device="cuda:0", **placement)
        policy = DreamZeroPolicy(DreamZeroConfig(view_size=TINY_VIEW_SIZE), RuntimeOptions(device="cuda:0"), model=model)
        spec = policy.kv_spec()
        cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, device="cuda:0")
        session = policy.start_session("s", cache.open_session("s"))
        return model, [policy.step(session, o).actions for o in observations(3)]

    model, split = actions(text_encoder_device="cpu", image_encoder_device="cpu")
    assert next(model.text_encoder.parameters()).device.type == "cpu" and next(model.dit.parameters()).device.type == "cuda"
    _, together = actions()
    for a, b in zip(together, split):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_the_server_refuses_a_plan_that_does_not_fit_in_one_line(tmp_path):
    """Through the real CLI: the worker prints its plan, refuses before loading, and the server exits."""
    import os
    import subprocess

    from tests.helpers.server_harness import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "ardiff_server", "--config", "tiny", "--port", "0", "--set", "engine.kv_budget_gib=100000"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    assert "memory plan: " in log and "KV pool" in log and "DOES NOT FIT" in log  # the plan, printed
    refusals = [line for line in log.splitlines() if re.search(r"memory plan: needs 100000\.\d GiB on cpu, has ", line)]
    assert len(refusals) == 2 and all("set engine.kv_budget_gib=" in line for line in refusals), log  # the worker's line, the server's
    assert "Traceback" not in log and "listening" not in log


def test_activations_and_scratch_follow_the_batch_the_pool_can_hold(droid):
    """engine.max_batch 4, but 80 GiB holds one 14B session beside the weights: the engine runs
    batches of one, so the plan counts one batch slot's scratch and activations (it fits); an
    H200 holds three beside the scratch, so batches of three."""
    settings = {"max_sessions": 4, "max_batch": 4, "kv_memory_fraction": 0.85}
    one_gpu = plan(droid, free_gib=79.5, **settings)
    kv = one_gpu.device("cuda:0").kv
    assert kv.sessions == 1 and kv.max_batch == 1
    one_gpu.check()
    roomy = plan(droid, free_gib=140.5, **{**settings, "kv_memory_fraction": 0.8})  # an H200: 3 sessions beside 4 slots' scratch
    assert roomy.device("cuda:0").kv.max_batch == 3 and roomy.device("cuda:0").activations > 2.5 * one_gpu.device("cuda:0").activations
    roomy.check()


def test_a_synthetic_5b_is_planned_at_the_canvas_its_vae_sees():
    """The 5B resizes the stitched 320x640 views to 160x320 before the VAE: its synthetic preset (the
    device run's calibration) must be planned at that size, as its checkpoint is."""
    assert memory.synthetic_geometry("synthetic:droid_5b").canvas == (160, 320)
    assert memory.synthetic_geometry("synthetic:droid").canvas == (352, 640)
