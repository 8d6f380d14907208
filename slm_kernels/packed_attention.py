"""Packed varlen causal GQA attention (prefill) in Triton, and its wrapper.

One program takes BLOCK_M positions of one sequence x the G query heads of one kv head as its rows,
and streams that sequence's K/V blocks up to the causal limit with an FP32 online softmax: no
score matrix is ever stored, no cross-sequence pair is computed, and each K/V tile is loaded once
for the whole group (never expanded per query head): 12 % faster at W1's prefill than one query
head per program. Key blocks wholly below the diagonal run without masks. Reference:
kernels.attention_ref.packed_attention_ref.

CUDA graphs use it (RuntimeSpec kernels "triton", the default on CUDA). Triton's CPU interpreter,
which the tests run it in, needs numpy < 2.4: with 2.4 a loop bound computed from tl.program_id
fails to convert ("only 0-dimensional arrays ...").
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from slm_kernels.online_softmax import launch_options, online_softmax_block

GROUPED_ROWS = 64  # query rows (positions x padded group) per program


@triton.jit
def _fold_keys(
    q,
    pos,
    k_ptr,
    v_ptr,
    start,
    n0,
    length,
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    scale,
    m_i,
    l_i,
    acc,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Fold keys n0..n0+BLOCK_N-1 into the rows' online-softmax state; MASKED: causal and
    sequence-end masks (the blocks on the diagonal), else every key counts for every row."""
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    k_at = k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
    v_at = v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :]
    if MASKED:
        col_ok = cols < length
        k, v = tl.load(k_at, mask=col_ok[:, None], other=0.0), tl.load(v_at, mask=col_ok[:, None], other=0.0)
    else:
        k, v = tl.load(k_at), tl.load(v_at)
    s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # AOTI passes scale as fp64
    if MASKED:
        s = tl.where((cols[None, :] <= pos[:, None]) & col_ok[None, :], s, float("-inf"))
    return online_softmax_block(s, v, m_i, l_i, acc)


@triton.jit
def _packed_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Row r of a program: position first + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD
    (the group padded to a power of two: 7 query heads per kv head in Qwen2.5-0.5B)."""
    m_block, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    first = m_block * BLOCK_M  # the program's first position
    if first >= length:
        return
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    pos, head = first + r // GROUP_PAD, kv_head * GROUP + r % GROUP_PAD
    row_ok = (pos < length) & (r % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (start + pos)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    full = first // BLOCK_N * BLOCK_N  # keys before every row of the program and inside the sequence
    for n0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _fold_keys(
            q,
            pos,
            k_ptr,
            v_ptr,
            start,
            n0,
            length,
            kv_head,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            scale,
            m_i,
            l_i,
            acc,
            HEAD_DIM,
            BLOCK_N,
            False,
        )
    for n0 in range(full, tl.minimum(first + BLOCK_M, length), BLOCK_N):
        m_i, l_i, acc = _fold_keys(
            q,
            pos,
            k_ptr,
            v_ptr,
            start,
            n0,
            length,
            kv_head,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            scale,
            m_i,
            l_i,
            acc,
            HEAD_DIM,
            BLOCK_N,
            True,
        )
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (start + pos)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton_op("slm::packed_attention", mutates_args={})  # exports into AOTInductor graphs
def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int,
    block_m: int = 0,
    block_n: int = 0,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [N+1] int32; max_seqlen: a bound on every
    sequence's length (the task bound: the grid is static). Returns [T, Hq, D] in q's dtype.
    block_m: positions per program, each with the group's query heads; 0 for GROUPED_ROWS rows.
    block_n: keys per block, 0 for 8 KB K/V tiles (32 keys at D = 128, 64 at 64): the fastest at
    W1 and W3 (bench.kernels_bench)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or d not in (16, 32, 64, 128) or k.shape != v.shape or k.shape[0] != t:
        raise ValueError(f"packed_attention: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        raise ValueError("packed_attention: the head dimension must be contiguous")
    out = torch.empty_like(q)
    group_pad = triton.next_power_of_2(hq // hkv)
    block_m = block_m or max(1, GROUPED_ROWS // group_pad)
    grid = (triton.cdiv(max_seqlen, block_m), cu_seqlens.shape[0] - 1, hkv)
    wrap_triton(_packed_attention_kernel)[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        GROUP_PAD=group_pad,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n or min(128, 4096 // d),
        **launch_options(num_warps, num_stages),
    )
    return out
