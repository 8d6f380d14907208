"""Exact row-wise top-k for the beam step's selections, in Triton: the k largest values of each row
and their columns, in column order. Reference: torch.topk(x, k, dim=1, sorted=False) (the same
values; among equal values at the k-th place the lowest columns, where torch.topk takes any).

Why: every beam step takes several top-k's of short rows (a few thousand values): each prompt's
best continuations, its running beams and its finished pool. torch.topk runs each as a radix
select over global memory, one block per row or several kernels per row, where these rows fit in
one program's registers.

How: one program takes a chunk of a row (at most `block` columns) into registers as int32 keys
that order as the floats do, and finds its k-th largest key by bisection over the key range: each
step counts the keys at or above the middle, and stops early once exactly k are. The keys above
it and the first of those equal to it (by column) make k; a prefix sum gives each its slot. A
row longer than `block` is cut into chunks whose top k's go through the same kernel again, until
one chunk is left: each level keeps the row's top k, since a value among the row's k largest is
among its own chunk's k largest.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from slm_kernels.online_softmax import launch_options


@triton.jit
def _order_keys(x):
    """int32 keys ordered as the fp32 values x (-0 just below +0, NaN above +inf as in torch.topk):
    a negative float's bits, read as int32, order backwards, so its 31 low bits are flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x != x, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))


@triton.jit
def _row_topk_kernel(
    x_ptr,
    ids_ptr,
    values_ptr,
    out_ids_ptr,
    n,
    k,
    stride_x,
    stride_ids,
    HAS_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, chunk): the top k of columns chunk*BLOCK.. of row `row` (k <= BLOCK), written
    to slots (row * chunks + chunk) * k .. + k-1 of the outputs in column order; with HAS_IDS, the
    columns' ids come from ids_ptr (an earlier level's), else they are the columns themselves."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=float("-inf"))
    keys = tl.where(valid, _order_keys(x.to(tl.float32)), -2147483648)  # padding below every value
    lo = tl.min(keys, 0).to(tl.int64)  # count(keys >= lo) >= k throughout
    hi = tl.max(keys, 0).to(tl.int64)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        at_or_above = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), 0)
        enough = at_or_above >= k
        lo = tl.where(enough, mid, lo)
        # exactly k at or above mid: the same set as at the k-th key, so the search ends
        hi = tl.where(enough, tl.where(at_or_above == k, mid, hi), mid - 1)
    kth = lo.to(tl.int32)
    above = keys > kth
    tied = keys == kth
    need = k - tl.sum(above.to(tl.int32), 0)
    chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= need))
    slot = (row * tl.num_programs(1) + chunk) * k + tl.cumsum(chosen.to(tl.int32), 0) - 1
    if HAS_IDS:
        ids = tl.load(ids_ptr + row * stride_ids + cols, mask=valid, other=0)
    else:
        ids = cols.to(tl.int64)
    tl.store(values_ptr + slot, x, mask=chosen)
    tl.store(out_ids_ptr + slot, ids, mask=chosen)


def _level(x, ids, k: int, block: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    # the whole row in one chunk, or chunks of at least 2k columns, so that each level halves them
    size = min(max(block, 2 * triton.next_power_of_2(k)), triton.next_power_of_2(n))
    chunks = triton.cdiv(n, size)
    values = torch.empty(rows, chunks * k, dtype=x.dtype, device=x.device)
    out_ids = torch.empty(rows, chunks * k, dtype=torch.int64, device=x.device)
    wrap_triton(_row_topk_kernel)[(rows, chunks)](
        x,
        x if ids is None else ids,  # not read without ids
        values,
        out_ids,
        n,
        k,
        x.stride(0),
        0 if ids is None else ids.stride(0),
        HAS_IDS=ids is not None,
        BLOCK=size,
        **launch_options(num_warps, 3),
    )
    return values, out_ids


@triton_op("slm::row_topk", mutates_args={})  # exports into AOTInductor graphs
def row_topk(x: torch.Tensor, k: int, block: int = 8192, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, N] bf16 or fp32, 1 <= k <= N. Returns the k largest values per row [R, k] (x's dtype)
    and their columns [R, k] int64, in column order. `block`: the most columns one program takes
    (a power of two; a chunk takes 2k at least)."""
    return top_k_rows(x, k, block, num_warps)


def top_k_rows(x: torch.Tensor, k: int, block: int = 8192, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """row_topk's kernels as a plain function: the op's body."""
    rows, n = x.shape
    if not isinstance(n, int):
        # the chunk size and the number of levels follow from the row length: traced with a
        # symbolic one, they nest into an expression whose range analysis does not finish
        raise ValueError("row_topk: the row length must be static where the graph is traced (use torch.topk)")
    if not 1 <= k <= n or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"row_topk: unsupported k={k} for {tuple(x.shape)} {x.dtype}")
    if block & (block - 1):
        raise ValueError(f"row_topk: block={block} is not a power of two")
    values, ids = _level(x, None, k, block, num_warps)
    while values.shape[1] > k:
        values, ids = _level(values, ids, k, block, num_warps)
    return values, ids
