"""Shared-prefix beam decode attention in Triton, and its wrapper.

The W beams of each of B prompts attend over their prompt's K/V, stored once in a packed
[T, Hkv, D] (prompt b at rows cu[b]..cu[b+1]-1), plus their own suffix ([B*W, S, Hkv, D]) in one
FP32 online softmax, without concatenating anything. One program takes BLOCK_W beams of one
prompt × the G query heads of one kv head as its M rows, so each prompt K/V tile is read once per
group of beams (the Hydragen / cascade-attention idea). A prompt's keys are not split between
programs (flash-decoding): at W2's and W3's decode shapes that was no faster (bench/RESULTS.md).
Reference: slm_kernels.attention_ref.prefix_suffix_attention_ref.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from slm_kernels.online_softmax import launch_options, online_softmax_block


@triton.jit
def _rows(w_block, kv_head, prompt, width, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_W: tl.constexpr):
    """A program's M rows: row r is beam w_block*BLOCK_W + r // GROUP_PAD of this prompt, query head
    kv_head*GROUP + r % GROUP_PAD (the group is padded to a power of two: 7 query heads per kv head
    in Qwen2.5-0.5B, 3 in SmolLM2). Returns (beam, head, ok) per row."""
    rows = tl.arange(0, BLOCK_W * GROUP_PAD)
    local = w_block * BLOCK_W + rows // GROUP_PAD
    ok = (local < width) & (rows % GROUP_PAD < GROUP)
    return prompt * width + local, kv_head * GROUP + rows % GROUP_PAD, ok


@triton.jit
def _queries(q_ptr, beam, head, ok, stride_qw, stride_qh, HEAD_DIM: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    return tl.load(
        q_ptr + beam[:, None] * stride_qw + head[:, None] * stride_qh + dims[None, :], mask=ok[:, None], other=0.0
    )


@triton.jit
def _prefix_blocks(
    q,
    kp_ptr,
    vp_ptr,
    start,
    lo,
    hi,
    kv_head,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    scale,
    M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online-softmax state (m, l, unnormalised output) of the M rows over the shared prompt's
    keys lo..hi-1 (one K/V tile for all rows); (-inf, 0, 0) when there are none."""
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(
            kp_ptr + (start + cols)[:, None] * stride_kpt + kv_head * stride_kph + dims[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            vp_ptr + (start + cols)[:, None] * stride_vpt + kv_head * stride_vph + dims[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # AOTI passes scale as fp64
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_block(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _suffix_keys(
    q,
    ks_ptr,
    vs_ptr,
    beam,
    ok,
    kv_head,
    stride_ksw,
    stride_kss,
    stride_ksh,
    stride_vsw,
    stride_vss,
    stride_vsh,
    scale,
    m_i,
    l_i,
    acc,
    SUFFIX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Fold each beam's own generated tokens (a handful: one key per row) into (m_i, l_i, acc)."""
    dims = tl.arange(0, HEAD_DIM)
    for j in range(SUFFIX):
        k = tl.load(
            ks_ptr + beam[:, None] * stride_ksw + j * stride_kss + kv_head * stride_ksh + dims[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        v = tl.load(
            vs_ptr + beam[:, None] * stride_vsw + j * stride_vss + kv_head * stride_vsh + dims[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        s = (tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * scale).to(tl.float32)
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prefix_attention_kernel(
    q_ptr,
    kp_ptr,
    vp_ptr,
    ks_ptr,
    vs_ptr,
    o_ptr,
    cu_ptr,
    scale,
    width,
    stride_qw,
    stride_qh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_ksw,
    stride_kss,
    stride_ksh,
    stride_vsw,
    stride_vss,
    stride_vsh,
    stride_ow,
    stride_oh,
    SUFFIX: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: its rows over the whole prompt, then their suffixes, then the output."""
    w_block, kv_head, prompt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + prompt)  # this prompt's K/V rows in the packed prefix
    prefix_len = tl.load(cu_ptr + prompt + 1) - start
    beam, head, ok = _rows(w_block, kv_head, prompt, width, GROUP, GROUP_PAD, BLOCK_W)
    q = _queries(q_ptr, beam, head, ok, stride_qw, stride_qh, HEAD_DIM)
    m_i, l_i, acc = _prefix_blocks(
        q,
        kp_ptr,
        vp_ptr,
        start,
        0,
        prefix_len,
        kv_head,
        stride_kpt,
        stride_kph,
        stride_vpt,
        stride_vph,
        scale,
        BLOCK_W * GROUP_PAD,
        HEAD_DIM,
        BLOCK_N,
    )
    dims = tl.arange(0, HEAD_DIM)
    m_i, l_i, acc = _suffix_keys(
        q,
        ks_ptr,
        vs_ptr,
        beam,
        ok,
        kv_head,
        stride_ksw,
        stride_kss,
        stride_ksh,
        stride_vsw,
        stride_vss,
        stride_vsh,
        scale,
        m_i,
        l_i,
        acc,
        SUFFIX,
        HEAD_DIM,
    )
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + beam[:, None] * stride_ow + head[:, None] * stride_oh + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=ok[:, None],
    )


@triton_op("slm::prefix_suffix_attention", mutates_args={})  # exports into AOTInductor graphs
def prefix_suffix_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_suffix: torch.Tensor,
    v_suffix: torch.Tensor,
    scale: float,
    prefix_cu: torch.Tensor,
    block_w: int = 0,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """q: [B*W, Hq, D]; k/v_prefix: [T, Hkv, D] with prompt b at rows prefix_cu[b]..prefix_cu[b+1]-1;
    k/v_suffix: [B*W, S, Hkv, D], S >= 0; prefix_cu: [B+1] int32. Returns [B*W, Hq, D]. block_w: beams per
    program; 0 picks 64 M rows (beams x query heads per kv head, padded to a power of two), the
    fastest at W=100 and 400 (bench.kernels_bench), or fewer, at least 16, when a prompt has fewer
    beams (one row per sequence: a prefill's last layer)."""
    rows, hq, d = q.shape
    hkv = k_prefix.shape[1]
    s = k_suffix.shape[1]
    prompts = prefix_cu.shape[0] - 1
    if (
        hq % hkv
        or d not in (16, 32, 64, 128)
        or k_suffix.shape != (rows, s, hkv, d)
        or v_prefix.shape != k_prefix.shape
    ):
        raise ValueError(
            f"prefix_suffix_attention: unsupported shapes q {tuple(q.shape)}, "
            f"prefix {tuple(k_prefix.shape)}, suffix {tuple(k_suffix.shape)}, {prompts} prompts"
        )
    if any(t.stride(-1) != 1 for t in (q, k_prefix, v_prefix, k_suffix, v_suffix)):
        raise ValueError("prefix_suffix_attention: the head dimension must be contiguous")
    width = rows // prompts  # the beams of one prompt (rows are a whole number of prompts' beams)
    group_pad = triton.next_power_of_2(hq // hkv)
    rows_per_program = min(64, max(16, triton.next_power_of_2(width * group_pad)))  # tl.dot takes M >= 16
    block_w = block_w or max(1, rows_per_program // group_pad)
    out = torch.empty_like(q)
    grid = (triton.cdiv(width, block_w), hkv, prompts)
    # No suffix (a prefill's last layer, one row per sequence): its K/V are never read, but an empty
    # CUDA tensor's pointer is null, which a kernel launch may refuse; the prefix's stands in.
    ks, vs = (k_prefix, v_prefix) if s == 0 else (k_suffix, v_suffix)
    group = dict(GROUP=hq // hkv, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_W=block_w)
    wrap_triton(_prefix_attention_kernel)[grid](
        q,
        k_prefix,
        v_prefix,
        ks,
        vs,
        out,
        prefix_cu,
        scale,
        width,
        q.stride(0),
        q.stride(1),
        k_prefix.stride(0),
        k_prefix.stride(1),
        v_prefix.stride(0),
        v_prefix.stride(1),
        k_suffix.stride(0),
        k_suffix.stride(1),
        k_suffix.stride(2),
        v_suffix.stride(0),
        v_suffix.stride(1),
        v_suffix.stride(2),
        out.stride(0),
        out.stride(1),
        SUFFIX=s,
        BLOCK_N=block_n,
        **group,
        **launch_options(num_warps, num_stages),
    )
    return out
