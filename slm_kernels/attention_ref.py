"""Pure-PyTorch references for the two attention shapes of the engine.

Both take GQA tensors as they are (q heads grouped over kv heads, K/V never expanded), compute in
FP32 and return the query dtype. They are the interface the Triton kernels implement and the
baseline they are tested against; they favour clarity over speed (the prefill one builds a dense
[T, T] mask, so keep T small outside tests).

Layout changes go through `_to_layout` (a copy into a fresh contiguous tensor) rather than
permute+reshape: a reshape of a permuted tensor makes torch.export guard the dynamic token count
against 1, which would forbid one-token requests in the exported graph.
"""

import torch

from slm_kernels.layer_ref import as_dtype


def _to_layout(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """x.permute(dims) copied into a new contiguous fp32 tensor."""
    out = x.new_empty([x.shape[i] for i in dims], dtype=torch.float32)
    return out.copy_(x.permute(dims))


def sequence_of_tokens(cu_seqlens: torch.Tensor, t: int | torch.SymInt) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to. A compare-and-count over the N
    boundaries rather than searchsorted: Inductor (torch 2.11, CUDA) cannot lower searchsorted over
    a slice of a tensor computed in the graph, as the beam graph's [0, Lp] is."""
    idx = torch.arange(t, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (idx[:, None] >= cu_seqlens[None, 1:]).sum(1)


def packed_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Block-diagonal causal attention over packed sequences.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [N+1] int32, cu_seqlens[0] = 0, cu_seqlens[N] = T.
    Token i of sequence s attends to tokens j of s with j <= i. Returns [T, Hq, D] in q's dtype.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv  # query head h reads kv head h // g (transformers' repeat_kv)
    idx = torch.arange(t, device=q.device, dtype=cu_seqlens.dtype)
    seq = sequence_of_tokens(cu_seqlens, t)
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])  # [Tq, Tk]
    # bmm over kv heads with the query group folded into M: K/V are never expanded.
    qg = _to_layout(q.view(t, hkv, g, d), (1, 2, 0, 3)).view(hkv, g * t, d)
    s = torch.bmm(qg, _to_layout(k, (1, 2, 0))).view(hkv, g, t, t) * scale  # [Hkv, G, Tq, Tk]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    o = torch.bmm(p.view(hkv, g * t, t), _to_layout(v, (1, 0, 2)))  # [Hkv, G*T, D]
    return as_dtype(_to_layout(o.view(hkv, g, t, d), (2, 0, 1, 3)).view(t, hq, d), q.dtype)


def prefix_suffix_attention_ref(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_suffix: torch.Tensor,
    v_suffix: torch.Tensor,
    scale: float,
    prefix_cu: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the beams of B prompts, each prompt's W beams sharing its prompt K/V.

    q: [B*W, Hq, D] (each beam's newest token; prompt b's beams are rows b*W .. b*W+W-1);
    k_prefix, v_prefix: [T, Hkv, D], the B prompts' K/V packed once (no beam dimension);
    prefix_cu: [B+1] int32, prompt b's K/V are rows prefix_cu[b] .. prefix_cu[b+1]-1;
    k_suffix, v_suffix: [B*W, S, Hkv, D], each beam's own generated tokens (the newest included).
    A beam sees all of its prompt and all of its suffix, in one softmax; prefix and suffix K/V
    are never joined. Returns [B*W, Hq, D].
    """
    rows, hq, d = q.shape
    t, hkv, _ = k_prefix.shape
    s_len = k_suffix.shape[1]
    g = hq // hkv
    # Prefix: all beams × the query group of one kv head form M against the packed prompt K/V;
    # a beam's scores outside its own prompt are masked.
    q_pre = _to_layout(q.view(rows, hkv, g, d), (1, 0, 2, 3)).view(hkv, rows * g, d)
    s_pre = torch.bmm(q_pre, _to_layout(k_prefix, (1, 2, 0))).view(hkv, rows, g, t)
    prompt = torch.arange(rows, device=q.device) // (rows // (prefix_cu.shape[0] - 1))  # [B*W]
    own = sequence_of_tokens(prefix_cu, t)[None, :] == prompt[:, None]  # [B*W, T]
    s_pre = s_pre.masked_fill(~own[None, :, None, :], float("-inf"))
    # Suffix: each beam against its own tokens.
    q_suf = as_dtype(q, torch.float32).reshape(rows * hkv, g, d)
    k_suf = _to_layout(k_suffix, (0, 2, 3, 1)).view(rows * hkv, d, s_len)
    s_suf = _to_layout(torch.bmm(q_suf, k_suf).view(rows, hkv, g, s_len), (1, 0, 2, 3))  # [Hkv, R, G, S]
    p = torch.softmax(torch.cat([s_pre, s_suf], dim=-1) * scale, dim=-1)  # one softmax over T + S
    o_pre = torch.bmm(_to_layout(p[..., :t], (0, 1, 2, 3)).view(hkv, rows * g, t), _to_layout(v_prefix, (1, 0, 2)))
    p_suf = _to_layout(p[..., t:], (1, 0, 2, 3)).view(rows * hkv, g, s_len)
    o_suf = torch.bmm(p_suf, _to_layout(v_suffix, (0, 2, 1, 3)).view(rows * hkv, s_len, d))  # [R*Hkv, G, D]
    o = _to_layout(o_pre.view(hkv, rows, g, d), (1, 0, 2, 3)) + o_suf.view(rows, hkv, g, d)
    return as_dtype(o.view(rows, hq, d), q.dtype)


def random_prefix_inputs(
    width: int,
    prompts: list[int],
    suffix: int,
    heads: tuple[int, int, int],
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    """Random (q, k_prefix, v_prefix, k_suffix, v_suffix, prefix_cu) for `width` beams of each
    prompt (token counts `prompts`), `suffix` generated tokens, heads (q heads, kv heads, head dim):
    what tests and benches feed prefix_suffix_attention and its reference."""
    hq, hkv, d = heads
    rows, t = width * len(prompts), sum(prompts)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    cu = torch.tensor([0] + list(prompts), device=device).cumsum(0).to(torch.int32)
    return (
        randn(rows, hq, d),
        randn(t, hkv, d),
        randn(t, hkv, d),
        randn(rows, suffix, hkv, d),
        randn(rows, suffix, hkv, d),
        cu,
    )
