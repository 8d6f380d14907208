"""The beam decode step's linears in Triton, each with the work around it in the same kernel:
- norm_qkv_rope: RMSNorm, the fused QKV projection (+ bias), QK-norm (Qwen3) and RoPE;
- linear_residual: the O or down projection (+ bias) and the residual add;
- norm_gate_up_silu: RMSNorm, the fused gate/up projection (+ bias) and SiLU(gate) * up.
References: slm_kernels.layer_ref (norm_qkv_rope_ref, linear_residual_ref, norm_gate_up_silu_ref).

A decode step multiplies a few hundred rows (the beams) by each layer's weights: the time goes to
reading the weights and to filling each kernel's pipeline, not to arithmetic. So each kernel
splits the weight rows into tiles and K into SPLITS slices, enough programs for every SM to stream
a share of the weights, and puts the elementwise steps before and after the GEMM into its
prologue and epilogue instead of kernels of their own.

Split-K: each program leaves its FP32 partial in a workspace and counts itself in on its tile's
counter; the program that arrives last sums the partials in slice order (the same sum whichever
program that is) and runs the epilogue, then zeroes the counter again. `counters` is zeroed once
by the caller and is zero again after every call.

RMSNorm enters as a row scale: x * g goes through the dot in the model dtype, each row's sum of
squares accumulates from the same tiles, and rsqrt(mean + eps) scales the dot's rows after.
Epilogues round where transformers rounds: the projection's output, then SiLU, the product, RoPE
and the residual sum in the model dtype.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _k_slice(K, split, SPLITS: tl.constexpr, BK: tl.constexpr):
    """This split's K range [lo, hi): whole BK blocks, the last slices shorter or empty."""
    per = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
    lo = split * per
    return lo, tl.minimum(lo + per, K)


@triton.jit
def _slice_dot(x_ptr, w_ptr, g_ptr, rows, r0, wrow, k_lo, k_hi, stride_x, stride_w,
               BM: tl.constexpr, BNW: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, SWAP: tl.constexpr,
               PRECISION: tl.constexpr):
    """acc [BM, BNW] fp32: rows r0.. of x (times g when NORM) over k_lo..k_hi, against the weight
    rows `wrow` [BNW]; ssq [BM]: each row's sum of squares over the slice (NORM). SWAP puts the
    weight rows on the dot's M side (wgmma's M is 64: fewer wasted lanes for a short row tile)."""
    r = r0 + tl.arange(0, BM)
    r_ok = r < rows
    dtype = x_ptr.dtype.element_ty
    ssq = tl.zeros([BM], tl.float32)
    if SWAP:
        acc = tl.zeros([BNW, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BNW], tl.float32)
    for k in tl.range(k_lo, k_hi, BK):
        kk = k + tl.arange(0, BK)
        x = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=r_ok[:, None], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ssq += tl.sum(xf * xf, 1)
            x = (xf * tl.load(g_ptr + kk).to(tl.float32)[None, :]).to(dtype)
        w = tl.load(w_ptr + wrow[:, None] * stride_w + kk[None, :])  # [BNW, BK]
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    return acc, ssq


@triton.jit
def _combine(acc, ssq, ws_ptr, cnt_ptr, slot, split, r_ok, SPLITS: tl.constexpr, BM: tl.constexpr,
             BNW: tl.constexpr):
    """Split-K: (acc, ssq) summed over the SPLITS slices of this tile in the program that arrives
    last (last=True), in slice order; the other programs only leave their partial."""
    part = BM * BNW + BM  # a partial: acc, then ssq
    m = tl.arange(0, BM)
    tile = m[:, None] * BNW + tl.arange(0, BNW)[None, :]
    base = ws_ptr + slot * (SPLITS * part)
    tl.store(base + split * part + tile, acc, mask=r_ok[:, None])
    tl.store(base + split * part + BM * BNW + m, ssq, mask=r_ok)
    tl.debug_barrier()  # every thread's stores come before the count that publishes them (release)
    last = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        acc = tl.zeros([BM, BNW], tl.float32)
        ssq = tl.zeros([BM], tl.float32)
        for s in tl.static_range(SPLITS):  # past L1: other SMs wrote these
            acc += tl.load(base + s * part + tile, mask=r_ok[:, None], other=0.0, cache_modifier=".cg")
            ssq += tl.load(base + s * part + BM * BNW + m, mask=r_ok, other=0.0, cache_modifier=".cg")
        tl.store(cnt_ptr + slot, 0)
    return acc, ssq, last


@triton.jit
def _project(x_ptr, w_ptr, g_ptr, ws_ptr, cnt_ptr, rows, K, wrow, stride_x, stride_w, BM: tl.constexpr,
             BNW: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr, SWAP: tl.constexpr,
             PRECISION: tl.constexpr):
    """This program's share of x[rows of its row tile] @ w[wrow]^T; in the program that finishes the
    tile (last), the whole product [BM, BNW] and the rows' sums of squares over all of K."""
    tile, split, row_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_lo, k_hi = _k_slice(K, split, SPLITS, BK)
    r0 = row_tile * BM
    acc, ssq = _slice_dot(x_ptr, w_ptr, g_ptr, rows, r0, wrow, k_lo, k_hi, stride_x, stride_w, BM, BNW, BK, NORM,
                          SWAP, PRECISION)
    last = True
    if SPLITS > 1:
        r_ok = r0 + tl.arange(0, BM) < rows
        acc, ssq, last = _combine(acc, ssq, ws_ptr, cnt_ptr, row_tile * tl.num_programs(0) + tile, split, r_ok,
                                  SPLITS, BM, BNW)
    return acc, ssq, last


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count
def _linear_residual_kernel(x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, rows, K, stride_x, stride_w,
                            stride_res, stride_out, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            SPLITS: tl.constexpr, BIAS: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """out = res + (x @ w^T + b): program (tile, split, row tile), tile = BN output columns."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    acc, _, last = _project(x_ptr, w_ptr, x_ptr, ws_ptr, cnt_ptr, rows, K, cols, stride_x, stride_w, BM, BN, BK,
                            SPLITS, False, SWAP, PRECISION)
    if last:
        r = tl.program_id(2) * BM + tl.arange(0, BM)
        ok = (r < rows)[:, None]
        dtype = out_ptr.dtype.element_ty
        if BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        res = tl.load(res_ptr + r[:, None] * stride_res + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r[:, None] * stride_out + cols[None, :], (acc.to(dtype).to(tl.float32) + res).to(dtype),
                 mask=ok)


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count
def _norm_gate_up_silu_kernel(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, rows, K, inner, eps, stride_x,
                              stride_w, stride_out, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              SPLITS: tl.constexpr, BIAS: tl.constexpr, SWAP: tl.constexpr,
                              PRECISION: tl.constexpr):
    """out[:, tile] = silu(gate) * up of rms_norm(x) @ w^T: the tile's BN gate rows and the same BN up
    rows interleaved (column 2j gate j, 2j + 1 up j), so the epilogue holds each pair."""
    c = tl.arange(0, 2 * BN)
    wrow = (c % 2) * inner + tl.program_id(0) * BN + c // 2
    acc, ssq, last = _project(x_ptr, w_ptr, g_ptr, ws_ptr, cnt_ptr, rows, K, wrow, stride_x, stride_w, BM, 2 * BN,
                              BK, SPLITS, True, SWAP, PRECISION)
    if last:
        dtype = out_ptr.dtype.element_ty
        y = acc * tl.rsqrt((ssq / K + eps).to(tl.float32))[:, None]  # AOTI may pass eps as fp64
        if BIAS:
            y += tl.load(b_ptr + wrow).to(tl.float32)[None, :]
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BM, BN, 2]))
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        r = tl.program_id(2) * BM + tl.arange(0, BM)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        tl.store(out_ptr + r[:, None] * stride_out + cols[None, :], (act * up).to(dtype), mask=(r < rows)[:, None])


@triton.jit
def _qk_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr, dtype: tl.constexpr):
    """Qwen3's RMSNorm over one head's two halves, rounded where transformers rounds."""
    d = tl.arange(0, HALF)
    rs = tl.rsqrt(((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps).to(tl.float32))[:, None]
    x1 = ((x1 * rs).to(dtype).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32)[None, :]).to(dtype)
    x2 = ((x2 * rs).to(dtype).to(tl.float32) * tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]).to(dtype)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit(do_not_specialize=["rows"])  # one binary for every row count
def _norm_qkv_rope_kernel(x_ptr, g_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, k_ptr, v_ptr, ws_ptr,
                          cnt_ptr, rows, K, eps, stride_x, stride_w, stride_cos, BM: tl.constexpr, BK: tl.constexpr,
                          SPLITS: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BIAS: tl.constexpr, QK_NORM: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """One head per tile (q heads, then k, then v): its columns' two halves interleaved (column 2j
    is j, 2j + 1 is HEAD_DIM/2 + j), so the epilogue holds each pair RoPE rotates together."""
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0)
    c = tl.arange(0, HEAD_DIM)
    wrow = head * HEAD_DIM + (c % 2) * HALF + c // 2
    acc, ssq, last = _project(x_ptr, w_ptr, g_ptr, ws_ptr, cnt_ptr, rows, K, wrow, stride_x, stride_w, BM, HEAD_DIM,
                              BK, SPLITS, True, SWAP, PRECISION)
    if last:
        dtype = q_ptr.dtype.element_ty
        y = acc * tl.rsqrt((ssq / K + eps).to(tl.float32))[:, None]
        if BIAS:
            y += tl.load(b_ptr + wrow).to(tl.float32)[None, :]
        x1, x2 = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BM, HALF, 2]))
        r = tl.program_id(2) * BM + tl.arange(0, BM)
        ok = (r < rows)[:, None]
        d = tl.arange(0, HALF)[None, :]
        if head < HEADS + KV_HEADS:  # q or k: normalised (Qwen3), then rotated
            if QK_NORM:
                if head < HEADS:
                    x1, x2 = _qk_norm(x1, x2, qn_ptr, eps, HALF, dtype)
                else:
                    x1, x2 = _qk_norm(x1, x2, kn_ptr, eps, HALF, dtype)
            cos = tl.load(cos_ptr + r[:, None] * stride_cos + d, mask=ok, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + r[:, None] * stride_cos + d, mask=ok, other=0.0).to(tl.float32)
            x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
            if head < HEADS:
                out = q_ptr + r[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + d
            else:
                out = k_ptr + r[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS) * HEAD_DIM + d
        else:
            out = v_ptr + r[:, None] * (KV_HEADS * HEAD_DIM) + (head - HEADS - KV_HEADS) * HEAD_DIM + d
        tl.store(out, x1.to(dtype), mask=ok)
        tl.store(out + HALF, x2.to(dtype), mask=ok)


def fits(hidden: int, q_size: int, inner: int, head_dim: int) -> bool:
    """Whether a model's decode projections fit these kernels: every K and N a multiple of 16, and
    heads of a power of two of at least 16 dims."""
    return all(n % 16 == 0 for n in (hidden, q_size, inner)) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _fit(block: int, total: int) -> int:
    """The largest power of two <= block, and at least 16, that divides total."""
    while block > 16 and total % block:
        block //= 2
    if total % block:
        raise ValueError(f"decode_linear: {total} is no multiple of 16")
    return block


def _launch(x: torch.Tensor, weight: torch.Tensor, tiles: int, tile_width: int, counters: torch.Tensor,
            block_m: int, block_k: int, splits: int, num_warps: int, num_stages: int) -> tuple:
    """(grid, workspace, launch keywords) of a kernel over `tiles` weight tiles of `tile_width`
    rows; checks what every kernel here needs of x and the weight."""
    rows, k = x.shape
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"decode_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} need the same K and "
                         "contiguous rows")
    if counters.dtype != torch.int32 or x.dtype != weight.dtype or block_m < 16:
        raise ValueError("decode_linear: counters are int32, x the weight's dtype and block_m at least 16")
    block_k = _fit(block_k, k)
    splits = max(1, min(splits, k // block_k))
    row_tiles = (rows + block_m - 1) // block_m
    if isinstance(row_tiles, int) and splits > 1 and counters.numel() < row_tiles * tiles:
        raise ValueError(f"decode_linear: {row_tiles * tiles} counters needed, {counters.numel()} given")
    ws = x.new_empty(row_tiles * tiles * splits * (block_m * tile_width + block_m) if splits > 1 else 1,
                     dtype=torch.float32)
    launch = dict(BM=block_m, BK=block_k, SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return (tiles, splits, row_tiles), ws, launch


@triton_op("slm::linear_residual", mutates_args={"counters"})
def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                    counters: torch.Tensor, block_m: int = 64, block_n: int = 64, block_k: int = 64, splits: int = 8,
                    swap: bool = False, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """residual + x @ weight^T (+ bias): x [T, K], weight [N, K], residual [T, N] -> [T, N]."""
    n = weight.shape[0]
    block_n = _fit(block_n, n)
    if residual.shape != (x.shape[0], n) or residual.stride(1) != 1:
        raise ValueError(f"linear_residual: weight {tuple(weight.shape)}, residual {tuple(residual.shape)}")
    grid, ws, launch = _launch(x, weight, n // block_n, block_n, counters, block_m, block_k, splits, num_warps,
                               num_stages)
    out = torch.empty_like(residual)
    wrap_triton(_linear_residual_kernel)[grid](
        x, weight, weight if bias is None else bias, residual, out, ws, counters, x.shape[0], x.shape[1], x.stride(0),
        weight.stride(0), residual.stride(0), out.stride(0), BN=block_n, BIAS=bias is not None, SWAP=swap, **launch)
    return out


@triton_op("slm::norm_gate_up_silu", mutates_args={"counters"})
def norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      eps: float, counters: torch.Tensor, block_m: int = 64, block_n: int = 32, block_k: int = 64,
                      splits: int = 1, swap: bool = False, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) @ weight^T (+ bias): x [T, K], weight [2I, K] (gate rows, then
    up rows) -> [T, I]."""
    inner = weight.shape[0] // 2
    block_n = _fit(block_n, inner)
    if weight.shape[0] % 2 or norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_gate_up_silu: weight {tuple(weight.shape)}, norm weight {tuple(norm_weight.shape)}")
    grid, ws, launch = _launch(x, weight, inner // block_n, 2 * block_n, counters, block_m, block_k, splits,
                               num_warps, num_stages)
    out = x.new_empty(x.shape[0], inner)
    wrap_triton(_norm_gate_up_silu_kernel)[grid](
        x, norm_weight, weight, weight if bias is None else bias, out, ws, counters, x.shape[0], x.shape[1], inner,
        eps, x.stride(0), weight.stride(0), out.stride(0), BN=block_n, BIAS=bias is not None, SWAP=swap, **launch)
    return out


@triton_op("slm::norm_qkv_rope", mutates_args={"counters"})
def norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, q_weight: Optional[torch.Tensor],
                  k_weight: Optional[torch.Tensor], eps: float, counters: torch.Tensor, block_m: int = 64,
                  block_k: int = 128, splits: int = 7, swap: bool = False, num_warps: int = 4, num_stages: int = 3,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As slm_kernels.layer_ref.qkv_rope_ref of rms_norm(x) @ weight^T (+ bias): x [T, K], weight
    [(heads + 2 kv_heads) * D, K], cos/sin [T, D] -> q [T, heads, D], k and v [T, kv_heads, D]."""
    t, d = x.shape[0], cos.shape[-1]
    if weight.shape[0] != (heads + 2 * kv_heads) * d or d & (d - 1) or d < 16 or cos.shape != (t, d):
        raise ValueError(f"norm_qkv_rope: weight {tuple(weight.shape)}, cos {tuple(cos.shape)}, {heads}/{kv_heads}")
    if cos.stride(1) != 1 or sin.stride() != cos.stride() or norm_weight.shape != (x.shape[1],):
        raise ValueError("norm_qkv_rope: cos and sin need contiguous rows, the norm weight x's width")
    grid, ws, launch = _launch(x, weight, heads + 2 * kv_heads, d, counters, block_m, block_k, splits, num_warps,
                               num_stages)
    q, k, v = x.new_empty(t, heads, d), x.new_empty(t, kv_heads, d), x.new_empty(t, kv_heads, d)
    norm = q_weight is not None
    wrap_triton(_norm_qkv_rope_kernel)[grid](
        x, norm_weight, weight, weight if bias is None else bias, cos, sin, q_weight if norm else x,
        k_weight if norm else x, q, k, v, ws, counters, t, x.shape[1], eps, x.stride(0), weight.stride(0),
        cos.stride(0), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, BIAS=bias is not None, QK_NORM=norm, SWAP=swap,
        **launch)
    return q, k, v
