"""Pure-PyTorch references for the two attention shapes of the engine.

Both take GQA tensors as they are (q heads grouped over kv heads, K/V never expanded), compute in
FP32 and return the query dtype. They are the interface the Triton kernels implement and the
baseline they are tested against; they favour clarity over speed (the prefill one builds a dense
[T, T] mask, so keep T small outside tests).
"""

import torch


def _group(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # q: [..., Hq, D] -> [..., Hkv, G, D] fp32, where query head h reads kv head h // G (HF's repeat_kv).
    *lead, hq, d = q.shape
    return q.float().reshape(*lead, kv_heads, hq // kv_heads, d)


def packed_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Block-diagonal causal attention over packed sequences.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [N+1] int32, cu_seqlens[0] = 0, cu_seqlens[N] = T.
    Token i of sequence s attends to tokens j of s with j <= i. Returns [T, Hq, D] in q's dtype.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    idx = torch.arange(t, device=q.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:], idx, right=True)  # [T] sequence of each token
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])  # [Tq, Tk]
    qg = _group(q, hkv)  # [T, Hkv, G, D]
    s = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    o = torch.einsum("hgqk,khd->qhgd", p, v.float())
    return o.reshape(t, hq, d).to(q.dtype)


def prefix_suffix_attention_ref(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_suffix: torch.Tensor,
    v_suffix: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step of W beams that share a prompt.

    q: [W, Hq, D] (each beam's newest token); k_prefix, v_prefix: [Lp, Hkv, D], the prompt K/V
    stored once for all beams; k_suffix, v_suffix: [W, S, Hkv, D], each beam's own generated tokens
    (the newest one included). All prefix and suffix positions are visible to the query. The two
    parts share one softmax; only their scores are joined, never their K/V. Returns [W, Hq, D].
    """
    w, hq, d = q.shape
    hkv = k_prefix.shape[1]
    lp = k_prefix.shape[0]
    qg = _group(q, hkv)  # [W, Hkv, G, D]
    s_pre = torch.einsum("whgd,lhd->whgl", qg, k_prefix.float())
    s_suf = torch.einsum("whgd,wshd->whgs", qg, k_suffix.float())
    p = torch.softmax(torch.cat([s_pre, s_suf], dim=-1) * scale, dim=-1)
    o = torch.einsum("whgl,lhd->whgd", p[..., :lp], v_prefix.float())
    o = o + torch.einsum("whgs,wshd->whgd", p[..., lp:], v_suffix.float())
    return o.reshape(w, hq, d).to(q.dtype)
