"""A decode layer-step's projections with the work around them fused in: one Triton GEMM
y = x W^T (+ b) whose epilogue finishes the step. References: slm_kernels.layer_ref
(norm_qkv_rope_ref, norm_gate_up_silu_ref, linear_residual_ref).

- norm_qkv_rope: RMSNorm -> QKV (+ bias) -> QK-norm (Qwen3) -> RoPE, writing q, k and v;
- norm_gate_up_silu: RMSNorm -> gate/up (+ bias) -> SiLU(gate) * up;
- linear_residual: residual + x W^T (+ bias) (the o- and down-projections), and the sums of
  squares of its output's rows, which the next norm needs.
So a decode layer-step is these four kernels and the attention, where cuBLAS GEMMs with
Inductor's norms and adds between them take eleven to fourteen (bench.step_bench).

Why one GEMM kernel: the decode rows are few (100 to 800 beams), so every projection is skinny.
Its cost is reading the weights and each kernel boundary, not arithmetic. Each program reads a
disjoint slice of W for all its rows.

How:
- The K loop is a plain GEMM: tiles of x and W go from memory to the tensor cores through the
  software pipeline (elementwise work on a tile inside the loop stops Triton from pipelining its
  load, which measured 2-3x slower).
- RMSNorm: its weight is folded into W's columns (W' = W diag(w_norm), fold_norm), and its
  per-row factor rsqrt(mean(x^2) + eps) scales the accumulator in the epilogue. The sum of
  squares of each row comes in as partial sums [P, T] from the kernel that wrote x (its column
  tiles), or from the embedding for the first layer. (transformers rounds the normalised x to the
  model dtype before the weight; here the factor stays FP32 and the weight is folded in the
  model dtype: as many roundings, at other points.)
- A program owns a tile of BLOCK_M rows and BLOCK_N output columns. Paired epilogues take two
  tiles of W at once: gate and up (columns j and I + j), or the two halves of a head's columns for
  RoPE (d and d + D/2), so the epilogue holds both halves.
- Split-K: when the row tiles times the column tiles fall short of the SMs, the K dimension is
  split across programs. Each writes its FP32 partial tile, and the last to arrive at the tile's
  counter (an atomic add) sums the partials in split order (the same result whatever the arrival
  order) and runs the epilogue, then zeroes the counter for the next call. The counters are a
  buffer the caller owns (`locks`, int32 zeros); a call leaves them zero.
- Rounding follows transformers where the unfused graph does: the projection's output is rounded
  to the model dtype (bias added in FP32 first), then the residual add, the SiLU and the product
  each round; QK-norm as slm_kernels.qkv_rope; RoPE in FP32, rounded once at the store.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from slm_kernels.online_softmax import launch_options
from slm_kernels.silu_mul import silu_times

# The epilogues: plain ints for launches (Inductor writes them into its generated source), and
# the same as constexprs for the kernels to compare with.
RESIDUAL, SILU, ROPE = 0, 1, 2
_RESIDUAL, _SILU, _ROPE = tl.constexpr(RESIDUAL), tl.constexpr(SILU), tl.constexpr(ROPE)
# Counters a caller's `locks` buffer holds: one per (row tile, column tile) of a split call. A call
# splits only when its tiles are at most half the target programs, so LOCKS bounds the target.
LOCKS = 1024
# Tiles and launch per op, read when a graph is traced: the fastest of bench.step_bench's op table
# summed over 100-800 rows. block_n: ROPE's is per half-head, at most D/2 (the whole half with
# QK-norm); programs: the split-K target, 0 for the GPU's SM count.
TILES = {
    "qkv": dict(block_m=64, block_n=32, block_k=64, programs=0, num_warps=4, num_stages=4),
    "gate_up": dict(block_m=64, block_n=64, block_k=64, programs=0, num_warps=4, num_stages=4),
    "o": dict(block_m=64, block_n=64, block_k=64, programs=0, num_warps=4, num_stages=4),
    "down": dict(block_m=128, block_n=64, block_k=128, programs=0, num_warps=8, num_stages=3),
}


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """W diag(w_norm) in W's dtype: the projection's weight with the RMSNorm weight before it folded in."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype)


@triton.jit
def _epilogue(
    acc1,
    acc2,
    m,
    row_ok,
    c1,
    c2,
    col_ok,
    tile_n,
    head,
    b_ptr,
    res_ptr,
    sq_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    sq_out_ptr,
    rows,
    sq_parts,
    eps,
    qk_eps,
    stride_res,
    stride_cos,
    N: tl.constexpr,
    K: tl.constexpr,
    NORM: tl.constexpr,
    PARTS: tl.constexpr,
    BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    if NORM:
        p = tl.arange(0, PARTS)[:, None]
        sq = tl.load(sq_ptr + p * rows + m[None, :], mask=(p < sq_parts) & row_ok[None, :], other=0.0)
        r = tl.rsqrt((tl.sum(sq, 0) / K + eps).to(tl.float32))[:, None]  # AOTI may pass eps as fp64
        acc1 = acc1 * r
        acc2 = acc2 * r
    if BIAS:
        acc1 += tl.load(b_ptr + c1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE != _RESIDUAL:
            acc2 += tl.load(b_ptr + c2, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y1 = acc1.to(dtype).to(tl.float32)  # the projection's output, in the model dtype
    y2 = acc2.to(dtype).to(tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    if EPILOGUE == _RESIDUAL:
        res = tl.load(res_ptr + m[:, None] * stride_res + c1[None, :], mask=ok, other=0.0).to(tl.float32)
        y = (y1 + res).to(dtype)
        tl.store(out_ptr + m[:, None] * N + c1[None, :], y, mask=ok)
        yf = tl.where(ok, y.to(tl.float32), 0.0)
        tl.store(sq_out_ptr + tile_n * rows + m, tl.sum(yf * yf, 1), mask=row_ok)  # this tile's part of each row's
    elif EPILOGUE == _SILU:
        tl.store(out_ptr + m[:, None] * N + c1[None, :], silu_times(y1, y2, dtype).to(dtype), mask=ok)
    else:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = c1 % HEAD_DIM  # columns of the head's first half
        if head < HEADS + KV_HEADS:  # q or k: normalised (QK_NORM) and rotated
            if QK_NORM:
                r = tl.rsqrt(((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / HEAD_DIM + qk_eps).to(tl.float32))[:, None]
                if head < HEADS:
                    w1 = tl.load(qw_ptr + d).to(tl.float32)[None, :]
                    w2 = tl.load(qw_ptr + HALF + d).to(tl.float32)[None, :]
                else:
                    w1 = tl.load(kw_ptr + d).to(tl.float32)[None, :]
                    w2 = tl.load(kw_ptr + HALF + d).to(tl.float32)[None, :]
                y1 = ((y1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
                y2 = ((y2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
            rot = m[:, None] * stride_cos + d[None, :]  # the first half; the second is equal
            cos = tl.load(cos_ptr + rot, mask=ok, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + rot, mask=ok, other=0.0).to(tl.float32)
            y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
        if head < HEADS:
            dst = out_ptr + m[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
        elif head < HEADS + KV_HEADS:
            dst = k_ptr + m[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS) * HEAD_DIM + d[None, :]
        else:
            dst = v_ptr + m[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS - KV_HEADS) * HEAD_DIM + d[None, :]
        tl.store(dst, y1.to(dtype), mask=ok)
        tl.store(dst + HALF, y2.to(dtype), mask=ok)


@triton.jit
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    res_ptr,
    sq_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    sq_out_ptr,
    part_ptr,
    lock_ptr,
    rows,
    k_blocks,
    sq_parts,
    eps,
    qk_eps,
    stride_x,
    stride_res,
    stride_cos,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    PARTS: tl.constexpr,
    BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (row tile, column tile, split): rows pid_m*BLOCK_M.., W rows c1 (and c2 when paired),
    k_blocks blocks of K columns from pid_k * k_blocks * BLOCK_K. N: output columns (RESIDUAL:
    x W^T's; SILU: I, the up half starting at W row N; ROPE: unused, the tile is head
    pid_n // (HALF // BLOCK_N)). NORM: the rows' sums of squares are sq_parts partial sums at
    sq_ptr [sq_parts, rows] (PARTS: a power of two at least sq_parts)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = m < rows
    n = tl.arange(0, BLOCK_N)
    if EPILOGUE == _ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        head = pid_n // (HALF // BLOCK_N)
        c1 = head * HEAD_DIM + (pid_n % (HALF // BLOCK_N)) * BLOCK_N + n
        c2 = c1 + HALF
        col_ok = n < BLOCK_N
    else:
        head = pid_n
        c1 = pid_n * BLOCK_N + n
        c2 = c1 + N  # SILU: the up half
        col_ok = c1 < N
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * (k_blocks * BLOCK_K)  # a multiple of BLOCK_K, so loads stay aligned and pipelined
    k_end = tl.minimum(k_start + k_blocks * BLOCK_K, K)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + kk
        k_ok = ks < k_end
        x = tl.load(x_ptr + m[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = col_ok[None, :] & k_ok[:, None]
        w1 = tl.load(w_ptr + c1[None, :].to(tl.int64) * K + ks[:, None], mask=w_ok, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc1 = tl.dot(x, w1, acc1, input_precision=PRECISION)
        if EPILOGUE != _RESIDUAL:
            w2 = tl.load(w_ptr + c2[None, :].to(tl.int64) * K + ks[:, None], mask=w_ok, other=0.0)
            acc2 = tl.dot(x, w2, acc2, input_precision=PRECISION)
    finish = splits == 1  # this program runs the epilogue: alone on its tile, or the last to arrive
    if splits > 1:
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        tile = pid_m * tl.num_programs(1) + pid_n
        at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + n[None, :]
        mine = part_ptr + (tile * splits + pid_k).to(tl.int64) * (2 * TILE)
        tl.store(mine + at, acc1)
        if EPILOGUE != _RESIDUAL:
            tl.store(mine + TILE + at, acc2)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release)
        finish = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == splits - 1
        if finish:
            acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, splits):  # in split order: the sum does not depend on who came last
                part = part_ptr + (tile * splits + s).to(tl.int64) * (2 * TILE)
                acc1 += tl.load(part + at, cache_modifier=".cg")
                if EPILOGUE != _RESIDUAL:
                    acc2 += tl.load(part + TILE + at, cache_modifier=".cg")
            tl.store(lock_ptr + tile, 0)
    if finish:
        _epilogue(
            acc1, acc2, m, row_ok, c1, c2, col_ok, pid_n, head, b_ptr, res_ptr, sq_ptr, cos_ptr, sin_ptr, qw_ptr,
            kw_ptr, out_ptr, k_ptr, v_ptr, sq_out_ptr, rows, sq_parts, eps, qk_eps, stride_res, stride_cos, N, K,
            NORM, PARTS, BIAS, EPILOGUE, HEADS, KV_HEADS, HEAD_DIM, QK_NORM,
        )  # fmt: skip


def _launch(
    x,
    w,
    out,
    locks,
    n_tiles,
    n,
    epilogue,
    *,
    sumsq=None,
    eps=0.0,
    bias=None,
    residual=None,
    sumsq_out=None,
    rope=(None, None),
    qk_weights=(None, None),
    qk_eps=0.0,
    kv_out=(None, None),
    heads=(1, 0, 2),
    block_m,
    block_n,
    block_k,
    programs,
    num_warps,
    num_stages,
):
    """Launch the kernel over x [T, K] and W [*, K]: the row tiles times n_tiles column tiles, and
    K split so that the programs reach `programs` (0: the GPU's SM count)."""
    rows, k = x.shape
    if x.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != k or x.dtype != w.dtype:
        raise ValueError(f"fused_linear: needs x [T, K] and W [N, K] with contiguous rows, got {x.shape}, {w.shape}")
    if locks.dtype != torch.int32 or not locks.is_contiguous() or locks.numel() < LOCKS:
        raise ValueError(f"fused_linear: locks must be {LOCKS} contiguous int32 zeros")
    if sumsq is not None and (sumsq.dtype != torch.float32 or sumsq.shape[1:] != (rows,) or not sumsq.is_contiguous()):
        raise ValueError(f"fused_linear: sums of squares must be contiguous FP32 [P, {rows}], got {sumsq.shape}")
    m_tiles = triton.cdiv(rows, block_m)
    if not programs:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    if programs > LOCKS:
        raise ValueError(f"fused_linear: a target of {programs} programs needs more than {LOCKS} counters")
    # The splits that fill the SMs, at least block_k columns each; SymInt-safe (rows is dynamic in the graphs).
    want = torch.sym_min(torch.sym_max(programs // (m_tiles * n_tiles), 1), triton.cdiv(k, block_k))
    k_blocks = triton.cdiv(triton.cdiv(k, want), block_k)
    splits = triton.cdiv(k, k_blocks * block_k)
    part = x.new_empty(m_tiles * n_tiles * splits * 2 * block_m * block_n, dtype=torch.float32)
    cos, sin = rope
    qw, kw = qk_weights
    k_out, v_out = kv_out
    h, kvh, d = heads
    parts = 1 if sumsq is None else sumsq.shape[0]
    wrap_triton(_fused_linear_kernel)[(m_tiles, n_tiles, splits)](
        x,
        w,
        x if bias is None else bias,
        x if residual is None else residual,
        part if sumsq is None else sumsq,
        x if cos is None else cos,
        x if sin is None else sin,
        x if qw is None else qw,
        x if kw is None else kw,
        out,
        out if k_out is None else k_out,
        out if v_out is None else v_out,
        part if sumsq_out is None else sumsq_out,
        part,
        locks,
        rows,
        k_blocks,
        parts,
        eps,
        qk_eps,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        0 if cos is None else cos.stride(0),
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=sumsq is not None,
        PARTS=triton.next_power_of_2(parts),
        BIAS=bias is not None,
        EPILOGUE=epilogue,
        HEADS=h,
        KV_HEADS=kvh,
        HEAD_DIM=d,
        QK_NORM=qw is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models exact; ignored for bf16
        **launch_options(num_warps, num_stages),
    )


def _tiles(op: str, block_m: int, block_n: int, programs: int) -> dict:
    """TILES[op] with the caller's block_m, block_n and programs where given (not 0)."""
    given = {"block_m": block_m, "block_n": block_n, "programs": programs}
    return {**TILES[op], **{key: value for key, value in given.items() if value}}


@triton_op("slm::linear_residual", mutates_args={"locks"})  # exports into AOTInductor graphs
def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    locks: torch.Tensor,
    op: str = "down",
    block_m: int = 0,
    block_n: int = 0,
    programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As slm_kernels.layer_ref.linear_residual_ref: residual + x W^T (+ bias) [T, N], and its rows'
    sums of squares as partial sums [column tiles, T] (FP32, of the output in its dtype). op: whose
    TILES ("o" or "down"); block_m, block_n, programs: in their place when not 0."""
    n = weight.shape[0]
    if residual.shape != (x.shape[0], n) or residual.stride(1) != 1:
        raise ValueError(f"linear_residual: residual {tuple(residual.shape)} for x {tuple(x.shape)}, W {weight.shape}")
    tiles = _tiles(op, block_m, block_n, programs)
    n_tiles = triton.cdiv(n, tiles["block_n"])
    out = x.new_empty(x.shape[0], n)
    sumsq = x.new_empty(n_tiles, x.shape[0], dtype=torch.float32)
    _launch(x, weight, out, locks, n_tiles, n, RESIDUAL, bias=bias, residual=residual, sumsq_out=sumsq, **tiles)
    return out, sumsq


@triton_op("slm::norm_gate_up_silu", mutates_args={"locks"})
def norm_gate_up_silu(
    x: torch.Tensor,
    sumsq: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    locks: torch.Tensor,
    block_m: int = 0,
    block_n: int = 0,
    programs: int = 0,
) -> torch.Tensor:
    """As slm_kernels.layer_ref.norm_gate_up_silu_ref: silu(gate) * up of RMSNorm(x), [T, I]; weight
    has the norm's weight folded in (fold_norm), sumsq holds the rows' sums of squares [P, T]."""
    inner = weight.shape[0] // 2
    if weight.shape[0] % 2:
        raise ValueError(f"norm_gate_up_silu: W {tuple(weight.shape)} is not gate and up")
    out = x.new_empty(x.shape[0], inner)
    tiles = _tiles("gate_up", block_m, block_n, programs)
    n_tiles = triton.cdiv(inner, tiles["block_n"])
    _launch(x, weight, out, locks, n_tiles, inner, SILU, sumsq=sumsq, eps=eps, bias=bias, **tiles)
    return out


@triton_op("slm::norm_qkv_rope", mutates_args={"locks"})
def norm_qkv_rope(
    x: torch.Tensor,
    sumsq: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    qk_eps: float,
    locks: torch.Tensor,
    block_m: int = 0,
    block_n: int = 0,
    programs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As slm_kernels.layer_ref.norm_qkv_rope_ref: q [T, heads, D], k and v [T, kv_heads, D]
    (contiguous); weight and sumsq as norm_gate_up_silu's. block_n: columns of each half-head per
    program, at most D/2 (the whole half with QK-norm, as the norm spans the head)."""
    t, d = x.shape[0], cos.shape[-1]
    half = d // 2
    tiles = _tiles("qkv", block_m, block_n, programs)
    block_n = tiles["block_n"] = half if q_weight is not None else min(tiles["block_n"], half)
    if (
        weight.shape[0] != (heads + 2 * kv_heads) * d
        or d % 2
        or d & (d - 1)
        or cos.shape != (t, d)
        or sin.stride() != cos.stride()
        or cos.stride(1) != 1
        or half % block_n
    ):
        raise ValueError(f"norm_qkv_rope: unsupported shapes W {tuple(weight.shape)}, cos {tuple(cos.shape)}")
    q = x.new_empty(t, heads, d)
    k = x.new_empty(t, kv_heads, d)
    v = x.new_empty(t, kv_heads, d)
    _launch(
        x, weight, q, locks, (heads + 2 * kv_heads) * (half // block_n), weight.shape[0], ROPE, sumsq=sumsq,
        eps=eps, bias=bias, rope=(cos, sin), qk_weights=(q_weight, k_weight), qk_eps=qk_eps, kv_out=(k, v),
        heads=(heads, kv_heads, d), **tiles,
    )  # fmt: skip
    return q, k, v
