"""The ``flex`` paged-attention backend (FlexAttention over the page pool in place).

Eager flex_attention applies ``mask_mod`` densely and never reads the BlockMask's block
indices, so those are checked twice: by emulating what the fused kernel reads (exact, cheap),
and once through the compiled CPU kernel at DreamZero-DROID's page size (880 tokens).
"""

from __future__ import annotations

import pytest
import torch

import ardiff_kv.attention as attention
from ardiff_kv import Branch, DenseKVCache, KVSpec, PagedKVCache, PagedLayerInputs, paged_attention, paged_write_attend

HEADS, DIM = 2, 8
SCALE = DIM**-0.5


def make(page=4, window=2, layers=1, extra=3, backend="flex", dtype=torch.float32, device="cpu", heads=HEADS, dim=DIM):
    spec = KVSpec(
        num_layers=layers, num_heads=heads, head_dim=dim, page_size=page, window_pages=window, max_new_pages=2, max_extra_tokens=extra, dtype=dtype
    )
    cache = PagedKVCache(spec, num_pages=2 * spec.pages_per_branch + 1, max_sessions=1, device=device, attention_backend=backend)
    return cache, cache.open_session("s")


def rand(n, heads=HEADS, dim=DIM, dtype=torch.float32, device="cpu"):
    return torch.randn(n, heads, dim, dtype=dtype, device=device)


def fill_pool(cache, dtype=torch.float32):
    for layer in range(cache.spec.num_layers):
        cache.storage.key_cache(layer).copy_(torch.randn_like(cache.storage.key_cache(layer), dtype=dtype))
        cache.storage.value_cache(layer).copy_(torch.randn_like(cache.storage.value_cache(layer), dtype=dtype))


def both_backends(cache, inputs, q):
    inputs = inputs._replace(max_seqlen_q=q.shape[0])
    flex = paged_attention(q, inputs._replace(backend="flex"), SCALE)
    sdpa = paged_attention(q, inputs._replace(backend="sdpa"), SCALE)
    return flex, sdpa


# --------------------------------------------------------------------- against sdpa, eager


@pytest.mark.parametrize("page", [4, 60, 200])
@pytest.mark.parametrize("history", [0, 1, 3])
@pytest.mark.parametrize("extra", [0, 3])
def test_flex_equals_sdpa_backend(page, history, extra):
    torch.manual_seed(page + history + extra)
    cache, s = make(page=page, window=3, extra=extra)
    fill_pool(cache)  # every page holds data: an invisible page that leaked in would show
    for _ in range(history):
        s.begin_forward(Branch.COND, num_video_tokens=page, commit=True).prepare()
        s.complete(Branch.COND)
    inputs = s.begin_forward(Branch.COND, num_video_tokens=2 * page, commit=False, extra_tokens=extra).prepare()[0]
    flex, sdpa = both_backends(cache, inputs, rand(2 * page + extra))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def test_rollout_with_flex_matches_upstream_concat_and_slice_across_window_restarts():
    """DreamZero's call order (prefill commit, denoise into scratch, window restart), 2 layers."""
    torch.manual_seed(1)
    page, window = 5, 9
    _, s = make(page=page, window=window, layers=2, extra=3)
    dense = DenseKVCache(num_layers=2, window_tokens=window * page)
    frames = 0
    for _call in range(12):
        if frames >= window:
            s.restart_window()
            dense = DenseKVCache(num_layers=2, window_tokens=window * page)
            frames = 0
        new = 1 if frames == 0 else 2
        for commit, extra in ((True, 0), (False, 3)):
            inputs = s.begin_forward(Branch.COND, num_video_tokens=new * page, commit=commit, extra_tokens=extra).prepare()
            layers = dense.layers(update=commit)
            for layer in range(2):
                q, k, v = rand(new * page + extra), rand(new * page), rand(new * page)
                ek, ev = (rand(extra), rand(extra)) if extra else (None, None)
                out = paged_write_attend(inputs[layer], q, k, v, ek, ev, SCALE)
                ref = layers[layer].attend(q[None], k[None], v[None], None if ek is None else ek[None], None if ev is None else ev[None], SCALE)[0]
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            s.complete(Branch.COND)
        frames += new


# ------------------------------------------------------------ block indices, as the kernel reads them


def kernel_view(mask, kv_len: int) -> torch.Tensor:
    """The keys each query block reads, as the fused kernel walks the BlockMask: the listed full
    blocks without mask_mod, the listed partial blocks through it. (q_blocks, kv_len) bool."""
    q_block, kv_block = mask.BLOCK_SIZE
    q_blocks = mask.kv_num_blocks.shape[-1]
    seen = torch.zeros(q_blocks, kv_len, dtype=torch.int32)
    kv_idx = torch.arange(kv_len)
    for i in range(q_blocks):
        for nums, idx, masked in ((mask.full_kv_num_blocks, mask.full_kv_indices, False), (mask.kv_num_blocks, mask.kv_indices, True)):
            for j in idx[0, 0, i, : int(nums[0, 0, i])].tolist():
                lo, hi = j * kv_block, min((j + 1) * kv_block, kv_len)
                keep = torch.ones(hi - lo, dtype=torch.bool)
                if masked:
                    keep = torch.as_tensor(mask.mask_mod(0, 0, torch.tensor(i * q_block), kv_idx[lo:hi]))
                seen[i, lo:hi] += keep.int()
    return seen


@pytest.mark.parametrize("page", [880, 60, 4, 200, 128, 129])
def test_block_mask_lists_exactly_the_visible_keys(page):
    """Full and partial block lists are disjoint, and together cover exactly the visible tokens
    (whole window pages, the extra page's first tokens) of a scrambled pool."""
    gen = torch.Generator().manual_seed(page)
    num_pages = 30
    for trial in range(6):
        width = 10
        visible = int(torch.randint(1, 10, (), generator=gen))
        extra = int(torch.randint(0, min(page, 25) + 1, (), generator=gen)) if trial % 2 else 0
        pages = (torch.randperm(num_pages - 1, generator=gen)[: visible + 1] + 1).tolist()  # never the null page
        table = pages[:visible] + (pages[visible:] if extra else [])
        table = torch.tensor([table + [0] * (width - len(table))], dtype=torch.int32)
        seq = torch.tensor([visible * page + extra], dtype=torch.int32)
        q_len = 2 * page + extra
        mask = attention._flex_block_mask(table, seq, num_pages, page, q_len)
        kv_len = num_pages * page
        truth = torch.zeros(kv_len, dtype=torch.int32)
        for p in pages[:visible]:
            truth[p * page : (p + 1) * page] = 1
        if extra:
            truth[pages[visible] * page : pages[visible] * page + extra] = 1
        seen = kernel_view(mask, kv_len)
        assert seen.max() <= 1, "a key block is listed twice (full and partial)"
        assert torch.equal(seen, truth.expand_as(seen)), f"page {page}, trial {trial}"


def test_mask_is_shared_by_layers_and_rebuilt_when_the_table_changes_in_place():
    cache, s = make(page=4, window=3, layers=3)
    fill_pool(cache)
    s.begin_forward(Branch.COND, num_video_tokens=4, commit=True).prepare()
    s.complete(Branch.COND)
    inputs = s.begin_forward(Branch.COND, num_video_tokens=8, commit=False, extra_tokens=3).prepare()
    table, seq = inputs[0].block_table, inputs[0].seq_lens
    first = attention._cached_block_mask(table, seq, *cache.storage.key_cache(0).shape[:2], 11)
    assert attention._cached_block_mask(inputs[2].block_table, inputs[2].seq_lens, *cache.storage.key_cache(0).shape[:2], 11) is first
    # A CUDA graph's static buffers are refilled in place: the mask must follow the new values.
    q = rand(11)
    before, _ = both_backends(cache, inputs[0], q)
    table.copy_(torch.roll(table, 1, dims=1))
    seq.copy_(seq - 4)
    flex, sdpa = both_backends(cache, inputs[0], q)
    assert attention._cached_block_mask(table, seq, *cache.storage.key_cache(0).shape[:2], 11) is not first
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(flex, before)


def test_fullgraph_compile_with_flex_does_not_recompile_when_values_change():
    from torch._dynamo.testing import CompileCounter

    _, s = make(page=4, window=4, layers=2)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def attend(inputs, q, k, v):
        return paged_write_attend(inputs, q, k, v, None, None, SCALE) * 1.0

    torch._dynamo.reset()
    for commit in (True, True, True, False, True):
        inputs = s.begin_forward(Branch.COND, num_video_tokens=4, commit=commit).prepare()
        for layer_inputs in inputs:
            attend(layer_inputs, rand(4), rand(4), rand(4))
        s.complete(Branch.COND)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_flex_over_a_batch_of_sequences_equals_each_sequence_alone():
    """B block-table rows in one flex call: each sequence sees only its own pages."""
    torch.manual_seed(3)
    cache, _ = make(page=4, window=3, extra=3)
    fill_pool(cache)
    gen = torch.Generator().manual_seed(0)
    num_pages = cache.storage.key_cache(0).shape[0]
    tables, lens = [], []
    for visible, extra in ((1, 0), (3, 3), (2, 1)):
        pages = (torch.randperm(num_pages - 1, generator=gen)[: visible + 1] + 1).tolist()
        row = pages[:visible] + ([pages[visible]] if extra else [])
        tables.append(row + [0] * (5 - len(row)))
        lens.append(visible * 4 + extra)
    table, seq = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    q = rand(3 * 7)
    batched = attention.flex_paged_attention(q, pool_inputs(cache, table, seq, 7), SCALE)
    for b in range(3):
        alone = attention.flex_paged_attention(q[b * 7 : (b + 1) * 7], pool_inputs(cache, table[b : b + 1], seq[b : b + 1], 7), SCALE)
        torch.testing.assert_close(batched[b * 7 : (b + 1) * 7], alone, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="equal query lengths"):
        attention.flex_paged_attention(rand(20), pool_inputs(cache, table, seq, 7), SCALE)


def pool_inputs(cache, table: torch.Tensor, seq: torch.Tensor, q_len: int) -> PagedLayerInputs:
    """Layer 0's pool under hand-made block-table rows (no slots: nothing is written)."""
    no_slots = torch.zeros(0, dtype=torch.long)
    cu_seqlens_q = torch.arange(table.shape[0] + 1, dtype=torch.int32) * q_len
    key_cache, value_cache = cache.storage.key_cache(0), cache.storage.value_cache(0)
    return PagedLayerInputs(key_cache, value_cache, no_slots, no_slots, table, cu_seqlens_q, seq, q_len, int(seq.max()), "flex")


# --------------------------------------------------------- the compiled kernel, DROID page size


def droid_cache(dtype, device, heads=1, dim=16):
    """DreamZero-DROID's page geometry (880 tokens, 9-frame window, 25 extra tokens)."""
    cache, s = make(page=880, window=9, extra=25, dtype=dtype, device=device, heads=heads, dim=dim)
    fill_pool(cache, dtype)
    return cache, s


def droid_forwards(s):
    """Denoise-shaped forwards at every window fill of a DreamZero window, plus a restart."""
    for frames in (1, 2, 2, 2, 2, None, 1):
        if frames is None:
            s.restart_window()
            continue
        s.begin_forward(Branch.COND, num_video_tokens=frames * 880, commit=True).prepare()
        s.complete(Branch.COND)
        yield s.begin_forward(Branch.COND, num_video_tokens=1760, commit=False, extra_tokens=25).prepare()[0]
        s.complete(Branch.COND)


def test_compiled_flex_kernel_on_cpu_matches_sdpa_at_droid_page_size():
    """One compile of the fused kernel (inductor's CPU template): it reads the block indices."""
    torch.manual_seed(0)
    _, s = droid_cache(torch.float32, "cpu")
    for inputs in droid_forwards(s):
        q = rand(1785, heads=1, dim=16)
        inputs = inputs._replace(max_seqlen_q=1785)
        sdpa = paged_attention(q, inputs._replace(backend="sdpa"), 0.25)
        flex = attention.flex_paged_attention(q, inputs, 0.25, compiled=True)
        torch.testing.assert_close(flex, sdpa, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU tests cover the mask and the compiled CPU kernel)")
def test_gpu_flex_matches_sdpa_at_droid_geometry_bf16():
    torch.manual_seed(0)
    cache, s = droid_cache(torch.bfloat16, "cuda", heads=8, dim=128)
    for inputs in droid_forwards(s):
        q = rand(1785, heads=8, dim=128, dtype=torch.bfloat16, device="cuda")
        flex, sdpa = both_backends(cache, inputs, q)
        torch.testing.assert_close(flex.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_flex_write_attend_replays_in_a_cuda_graph():
    """The op has no host syncs: captured once, replayed with new tables and lengths."""
    torch.manual_seed(0)
    _, s = droid_cache(torch.bfloat16, "cuda", heads=8, dim=128)
    forwards = list(droid_forwards(s))
    static = forwards[1]._replace(**{f: getattr(forwards[1], f).clone() for f in ("video_slots", "extra_slots", "block_table", "seq_lens")})
    q, k, v = (rand(n, 8, 128, torch.bfloat16, "cuda") for n in (1785, 1760, 1760))
    ek, ev = rand(25, 8, 128, torch.bfloat16, "cuda"), rand(25, 8, 128, torch.bfloat16, "cuda")
    run = lambda: paged_write_attend(static, q, k, v, ek, ev, 128**-0.5)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for fresh in forwards:
        for field in ("video_slots", "extra_slots", "block_table", "seq_lens"):
            getattr(static, field).copy_(getattr(fresh, field))
        graph.replay()
        expected = paged_write_attend(fresh._replace(backend="sdpa"), q, k, v, ek, ev, 128**-0.5)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
