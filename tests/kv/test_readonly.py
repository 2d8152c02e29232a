"""Read-only paged attention (guided continuations): the write + attend op's values, nothing written, a backward.

References: the paged op itself (sdpa backend) for the values, and dense attention over each sequence's
own history + new tokens for the gradient.
"""

from __future__ import annotations

import torch

from ardiff_kv import Branch, KVSpec, PagedKVCache, ReadOnlyPagedLayer, paged_write_attend, prepare_batch

PAGE, HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, HEADS, DIM, dtype=torch.float64)


def test_read_only_attention_equals_the_paged_op_writes_nothing_and_has_the_dense_gradient():
    torch.manual_seed(0)
    spec = KVSpec(
        num_layers=1, num_heads=HEADS, head_dim=DIM, page_size=PAGE, window_pages=5, max_new_pages=2, max_extra_tokens=3, dtype=torch.float64
    )
    cache = PagedKVCache(spec, num_pages=4 * 2 * spec.pages_per_branch + 1, max_sessions=4, attention_backend="sdpa", max_batch=2)
    sessions = {name: cache.open_session(name) for name in ("a", "b")}
    history: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"a": [], "b": []}
    for name, frames in (("a", 1), ("b", 4)):  # b's window is full and has evicted a page
        for _ in range(frames):
            ctx = sessions[name].begin_forward(Branch.COND, num_video_tokens=PAGE, commit=True)
            k, v = rand(PAGE), rand(PAGE)
            paged_write_attend(ctx.prepare()[0], rand(PAGE), k, v, None, None, SCALE)
            sessions[name].complete(Branch.COND)
            history[name].append((k, v))

    def denoise_inputs():
        contexts = [
            sessions[name].begin_forward(Branch.COND, num_video_tokens=2 * PAGE, commit=False, extra_tokens=3, scratch_slot=slot)
            for slot, name in enumerate(("a", "b"))
        ]
        return prepare_batch(contexts)[0]

    q, k, v, ke, ve = rand(2, 2 * PAGE + 3), rand(2, 2 * PAGE), rand(2, 2 * PAGE), rand(2, 3), rand(2, 3)
    reference = paged_write_attend(denoise_inputs(), q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), ke.flatten(0, 1), ve.flatten(0, 1), SCALE)
    for name in ("a", "b"):
        sessions[name].complete(Branch.COND)

    inputs = denoise_inputs()
    pools = (inputs.key_cache.clone(), inputs.value_cache.clone())
    k.requires_grad_(True)
    ke.requires_grad_(True)
    out = ReadOnlyPagedLayer(inputs).attend(q, k, v, ke, ve, SCALE)
    torch.testing.assert_close(out.flatten(0, 1), reference, atol=1e-12, rtol=0)
    assert torch.equal(inputs.key_cache, pools[0]) and torch.equal(inputs.value_cache, pools[1])  # nothing written

    weights = torch.randn_like(out)
    grad_k, grad_ke = torch.autograd.grad((out * weights).sum(), [k, ke])
    for i, name in enumerate(("a", "b")):
        kept = history[name][-(spec.window_pages - 2) :]  # the window keeps room for the 2 new pages
        k_i, ke_i = k[i].detach().requires_grad_(True), ke[i].detach().requires_grad_(True)
        keys = torch.cat([h[0] for h in kept] + [k_i, ke_i])
        values = torch.cat([h[1] for h in kept] + [v[i], ve[i]])
        dense = torch.nn.functional.scaled_dot_product_attention(q[i].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=SCALE)
        expected = torch.autograd.grad((dense.transpose(0, 1) * weights[i]).sum(), [k_i, ke_i])
        torch.testing.assert_close(grad_k[i], expected[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(grad_ke[i], expected[1], atol=1e-12, rtol=0)
    for name in ("a", "b"):
        sessions[name].complete(Branch.COND)
        cache.end_session(sessions[name])
