"""The attention references against a naive per-sequence computation with expanded K/V."""

import pytest
import torch

from slm_kernels import packed_attention_ref, prefix_suffix_attention_ref
from slm_kernels.attention_ref import random_prefix_inputs


def naive_attention(q, k, v, causal: bool, scale: float):
    # q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; K/V expanded per query head, as transformers does.
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if causal:
        tq, tk = s.shape[1:]
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double())


@pytest.mark.parametrize("lengths", [[1], [7], [1, 1, 1], [5, 1, 12, 3], [16] * 8, [2] * 64])
@pytest.mark.parametrize("heads", [(4, 4, 16), (6, 2, 64), (8, 1, 32)])
def test_packed_attention(lengths, heads):
    hq, hkv, d = heads
    torch.manual_seed(len(lengths))
    t = sum(lengths)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = packed_attention_ref(q, k, v, cu, d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = naive_attention(q[a:b], k[a:b], v[a:b], causal=True, scale=d**-0.5)
        torch.testing.assert_close(out[a:b].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [1, 4, 33])
@pytest.mark.parametrize("prompts, suffix", [([1], 1), ([9], 1), ([9], 5), ([40], 3), ([9, 1, 40], 2)])
@pytest.mark.parametrize("heads", [(4, 4, 16), (6, 2, 64), (8, 1, 32)])
def test_prefix_suffix_attention(width, prompts, suffix, heads):
    d = heads[2]
    torch.manual_seed(width + sum(prompts))
    rows = width * len(prompts)
    q, kp, vp, ks, vs, cu = random_prefix_inputs(width, prompts, suffix, heads)
    out = prefix_suffix_attention_ref(q, kp, vp, ks, vs, d**-0.5, cu)
    assert out.shape == q.shape
    for r in range(rows):  # beam r sees its own prompt followed by its own suffix
        a, b = cu[r // width].item(), cu[r // width + 1].item()
        k, v = torch.cat([kp[a:b], ks[r]]), torch.cat([vp[a:b], vs[r]])
        ref = naive_attention(q[r : r + 1], k, v, causal=False, scale=d**-0.5)
        torch.testing.assert_close(out[r : r + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_in_bf16_out_fp32_inside():
    torch.manual_seed(0)
    q, k, v = torch.randn(12, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = packed_attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, 0.25)
    ref = packed_attention_ref(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), cu, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
