"""Paged attention against independent dense references, the custom op, and torch.compile."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from ardiff_kv import Branch, DenseKVCache, KVSpec, PagedKVCache, paged_attention, paged_write_attend

PAGE, HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5


def make(window=2, layers=1, extra=3, dtype=torch.float32, device="cpu"):
    spec = KVSpec(
        num_layers=layers, num_heads=HEADS, head_dim=DIM, page_size=PAGE, window_pages=window, max_new_pages=2, max_extra_tokens=extra, dtype=dtype
    )
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, device=device)
    return cache, cache.open_session("s")


def dense_attention(q, k, v):
    """Plain softmax attention, (L, H, D) layout: the independent reference."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * SCALE
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def rand(n, dtype=torch.float32, device="cpu"):
    return torch.randn(n, HEADS, DIM, dtype=dtype, device=device)


def commit_history(session, n_pages):
    keys, values = [], []
    for _ in range(n_pages):
        ctx = session.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
        inputs = ctx.prepare()[0]
        k, v = rand(PAGE), rand(PAGE)
        paged_write_attend(inputs, rand(PAGE), k, v, None, None, SCALE)
        session.complete(Branch.COND)
        keys.append(k)
        values.append(v)
    return keys, values


@pytest.mark.parametrize("history", [0, 1, 3])
@pytest.mark.parametrize("extra", [0, 3])
@pytest.mark.parametrize("commit", [False, True])
def test_paged_equals_dense_attention(history, extra, commit):
    torch.manual_seed(0)
    _cache, s = make(window=2)
    hist_k, hist_v = commit_history(s, history)
    ctx = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=commit, extra_tokens=extra)
    inputs = ctx.prepare()[0]
    q, k, v = rand(PAGE + extra), rand(PAGE), rand(PAGE)
    ek, ev = (rand(extra), rand(extra)) if extra else (None, None)
    out = paged_write_attend(inputs, q, k, v, ek, ev, SCALE)

    # upstream semantics: cat(history, current)[-window:] then the extra tokens
    keys = torch.cat([*hist_k, k])[-2 * PAGE :]
    values = torch.cat([*hist_v, v])[-2 * PAGE :]
    if extra:
        keys, values = torch.cat([keys, ek]), torch.cat([values, ev])
    torch.testing.assert_close(out, dense_attention(q, keys, values), atol=1e-5, rtol=1e-5)

    before = s.branch(Branch.COND).committed_tokens
    s.complete(Branch.COND)
    assert s.branch(Branch.COND).committed_tokens == before + (PAGE if commit else 0)


def test_rollout_matches_upstream_concat_and_slice_across_window_restarts():
    """A DreamZero-shaped sequence of prefill (commit) and denoise (scratch) forwards, 2 layers."""
    torch.manual_seed(1)
    window = 9
    _cache, s = make(window=window, layers=2, extra=3)
    dense = DenseKVCache(num_layers=2, window_tokens=window * PAGE)
    frames_in_window = 0
    for _call in range(12):
        if frames_in_window >= window:  # DreamZero restarts the window when it is full
            s.restart_window()
            dense.reset()
            frames_in_window = 0
        steps = [(1 if frames_in_window == 0 else 2, True)] + [(2, False)] * 3  # prefill, then denoise steps
        for frames, commit in steps:
            extra = 0 if commit else 3
            inputs = s.begin_forward(Branch.COND, num_video_tokens=frames * PAGE, commit=commit, extra_tokens=extra).prepare()
            dense_layers = dense.layers(update=commit)
            for layer in range(2):
                q, k, v = rand(frames * PAGE + extra), rand(frames * PAGE), rand(frames * PAGE)
                ek, ev = (rand(extra), rand(extra)) if extra else (None, None)
                paged = paged_write_attend(inputs[layer], q, k, v, ek, ev, SCALE)
                reference = dense_layers[layer].attend(
                    q[None], k[None], v[None], None if ek is None else ek[None], None if ev is None else ev[None], SCALE
                )[0]
                torch.testing.assert_close(paged, reference, atol=1e-5, rtol=1e-5)
            s.complete(Branch.COND)
        frames_in_window += steps[0][0] + 2
    assert dense.num_tokens == len(s.branch(Branch.COND).resident) * PAGE


def test_custom_op_registration_is_idempotent():
    assert hasattr(torch.ops.ardiff, "paged_write_attend")
    saved = sys.modules.pop("ardiff_kv.attention")
    try:
        importlib.import_module("ardiff_kv.attention")  # re-registration must not raise
    finally:
        sys.modules["ardiff_kv.attention"] = saved
    assert hasattr(torch.ops.ardiff, "paged_write_attend")


def test_fullgraph_compile_does_not_recompile_when_values_change():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    _cache, s = make(window=4, layers=2)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def attend(inputs, q, k, v):
        return paged_write_attend(inputs, q, k, v, None, None, SCALE) * 1.0

    torch._dynamo.reset()
    for commit in (True, True, True, False, True):  # block ids, slots and table values change
        inputs = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=commit).prepare()
        for layer_inputs in inputs:  # a different layer index must not recompile either
            attend(layer_inputs, rand(PAGE), rand(PAGE), rand(PAGE))
        s.complete(Branch.COND)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_unknown_backend_and_flash_on_cpu_are_clear_errors():
    _, s = make()
    inputs = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False).prepare()[0]
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(rand(PAGE), inputs._replace(backend="magic"), SCALE)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        paged_attention(rand(PAGE), inputs._replace(backend="flash"), SCALE)


def _flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the sdpa path is covered on CPU)")
@pytest.mark.parametrize("history", [1, 3])
@pytest.mark.parametrize("extra", [0, 3])
def test_gpu_paged_attention_matches_dense(history, extra):
    torch.manual_seed(0)
    _cache, s = make(window=2, dtype=torch.float16, device="cuda")
    keys, values = [], []
    for _ in range(history):
        inputs = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True).prepare()[0]
        k, v = rand(PAGE, torch.float16, "cuda"), rand(PAGE, torch.float16, "cuda")
        paged_write_attend(inputs, rand(PAGE, torch.float16, "cuda"), k, v, None, None, SCALE)
        s.complete(Branch.COND)
        keys.append(k)
        values.append(v)
    inputs = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=False, extra_tokens=extra).prepare()[0]
    q = rand(PAGE + extra, torch.float16, "cuda")
    k, v = rand(PAGE, torch.float16, "cuda"), rand(PAGE, torch.float16, "cuda")
    ek, ev = (rand(extra, torch.float16, "cuda"), rand(extra, torch.float16, "cuda")) if extra else (None, None)
    out = paged_write_attend(inputs, q, k, v, ek, ev, SCALE)
    ref_k = torch.cat([*keys, k])[-2 * PAGE :]
    ref_v = torch.cat([*values, v])[-2 * PAGE :]
    if extra:
        ref_k, ref_v = torch.cat([ref_k, ek]), torch.cat([ref_v, ev])
    torch.testing.assert_close(out.float(), dense_attention(q.float(), ref_k.float(), ref_v.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_available(), reason="needs CUDA and vLLM's flash-attention (the GPU install: bash scripts/serve.sh --gpu)")
def test_gpu_flash_backend_matches_sdpa_backend_at_droid_page_size():
    spec = KVSpec(num_layers=1, num_heads=4, head_dim=128, page_size=880, window_pages=9, max_new_pages=2, max_extra_tokens=25, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, device="cuda")
    s = cache.open_session("s")
    for frames in (1, 2, 2):
        inputs = s.begin_forward(Branch.COND, num_video_tokens=frames * 880, commit=True).prepare()[0]
        n = frames * 880
        kv_ = torch.randn(n, 4, 128, dtype=torch.bfloat16, device="cuda")
        paged_write_attend(inputs, kv_, kv_, kv_, None, None, 128**-0.5)
        s.complete(Branch.COND)
    inputs = s.begin_forward(Branch.COND, num_video_tokens=1760, commit=False, extra_tokens=25).prepare()[0]
    q = torch.randn(1785, 4, 128, dtype=torch.bfloat16, device="cuda")
    inputs = inputs._replace(max_seqlen_q=1785)
    flash = paged_attention(q, inputs._replace(backend="flash"), 128**-0.5)
    sdpa = paged_attention(q, inputs._replace(backend="sdpa"), 128**-0.5)
    torch.testing.assert_close(flash.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_inductor_writes_the_pool_in_place_without_copying_it():
    """The op declares the K/V pools it mutates; each is a whole tensor (not a view of a shared
    base), so inductor calls the op on the pool itself: no clone-and-copy-back of a layer's pool."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    cache, s = make(window=4, layers=2)
    compiled = torch.compile(lambda inputs, q, k, v: paged_write_attend(inputs, q, k, v, None, None, SCALE) * 1.0, fullgraph=True)
    torch._dynamo.reset()
    inputs = s.begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True).prepare()
    k = rand(PAGE)
    expected = cache.storage.key_cache(1).clone()
    expected.view(-1, *expected.shape[2:]).index_copy_(0, inputs[1].video_slots, k)
    with inductor_config.patch(force_disable_caches=True):
        _, code = run_and_get_code(compiled, inputs[1], rand(PAGE), k, rand(PAGE))
    torch.testing.assert_close(cache.storage.key_cache(1), expected, atol=0, rtol=0)  # written in place
    source = "\n".join(code)
    assert "clone" not in source and "copy_" not in source, source
