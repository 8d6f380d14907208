"""Packed varlen causal GQA attention (prefill) in Triton, and its wrapper.

One program handles BLOCK_M query rows of one sequence: it streams that sequence's K/V blocks up
to the causal limit with an FP32 online softmax, so no score matrix is ever stored and no
cross-sequence pair is computed. K/V are read per kv head, never expanded. The graphs' kernel
(_packed_grouped_kernel) takes the G query heads of one kv head together as its rows, so each K/V
tile is loaded once per group; the first one (_packed_attention_kernel, for the kernel bench) one
query head per program. Reference: kernels.attention_ref.packed_attention_ref.

Status: checked against the reference in Triton's CPU interpreter (fp32) and timed on the H200
(bench/RESULTS.md). The graphs use it when built with RuntimeSpec(attention="triton"), the
archiver's default on CUDA since the H200 runs of issue 5 (as do kernels/qkv_rope.py and
kernels/silu_mul.py). The interpreter needs numpy < 2.4: with 2.4 a loop bound computed from
tl.program_id fails to convert ("only 0-dimensional arrays ...").
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.online_softmax import launch_options, online_softmax_block


@triton.jit
def _packed_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    if m_block * BLOCK_M >= length:
        return
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # positions within the sequence
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < length
    q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: no key beyond the block's last row; keys past the sequence end are masked below.
    for n0 in range(0, (m_block + 1) * BLOCK_M, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        k = tl.load(k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]; AOTI passes scale as fp64
        s = tl.where((cols[None, :] <= rows[:, None]) & col_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_block(s, v, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


GROUPED_ROWS = 64  # query rows (positions x padded group) per program of the grouped kernel


@triton.jit
def _packed_grouped_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M positions of one sequence x the GROUP query heads of one kv head as its
    M rows (row r: position r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile is read once for
    the whole group. Key blocks wholly below the diagonal run without masks; only the blocks on
    it are masked."""
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
    q = tl.load(q_ptr + (start + pos)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    full = first // BLOCK_N * BLOCK_N  # keys before every row of the program and inside the sequence
    for n0 in range(0, full, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :])
        v = tl.load(v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :])
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # AOTI passes scale as fp64
        m_i, l_i, acc = online_softmax_block(s, v, m_i, l_i, acc)
    for n0 in range(full, tl.minimum(first + BLOCK_M, length), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        k = tl.load(k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)
        s = tl.where((cols[None, :] <= pos[:, None]) & col_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_block(s, v, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (start + pos)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton_op("slm::packed_attention", mutates_args={})  # exports into AOTInductor graphs
def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, max_seqlen: int,
    block_m: int = 0, block_n: int = 0, num_warps: int = 4, num_stages: int = 3, grouped: bool = True,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [N+1] int32; max_seqlen: a bound on every
    sequence's length (the task bound: the grid is static). Returns [T, Hq, D] in q's dtype.
    grouped (the graphs'): one program per kv head, its query heads' rows together
    (_packed_grouped_kernel); block_m counts positions, each with the group's heads (padded to a
    power of two), 0 for GROUPED_ROWS rows; block_n 0: 8 KB K/V tiles (32 keys at D = 128, 64 at
    64), the fastest on the H200 at W1 and W3 (1.1x the ungrouped kernel, bench/RESULTS.md).
    Ungrouped: one program per query head, block_m rows, 0 for 64; block_n 0 for 64."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or d not in (16, 32, 64, 128) or k.shape != v.shape or k.shape[0] != t:
        raise ValueError(f"packed_attention: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        raise ValueError("packed_attention: the head dimension must be contiguous")
    out = torch.empty_like(q)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1))
    options = launch_options(num_warps, num_stages)
    if grouped:
        group_pad = triton.next_power_of_2(hq // hkv)
        block_m = block_m or max(1, GROUPED_ROWS // group_pad)
        block_n = block_n or min(128, 4096 // d)
        grid = (triton.cdiv(max_seqlen, block_m), cu_seqlens.shape[0] - 1, hkv)
        wrap_triton(_packed_grouped_kernel)[grid](
            q, k, v, out, cu_seqlens, scale, *strides, GROUP=hq // hkv, GROUP_PAD=group_pad, HEAD_DIM=d,
            BLOCK_M=block_m, BLOCK_N=block_n, **options,
        )
        return out
    block_m, block_n = block_m or 64, block_n or 64
    grid = (triton.cdiv(max_seqlen, block_m), cu_seqlens.shape[0] - 1, hq)
    wrap_triton(_packed_attention_kernel)[grid](
        q, k, v, out, cu_seqlens, scale, *strides,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, **options,
    )
    return out
