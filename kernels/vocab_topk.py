"""Exact row-wise top-k of logits and their log-sum-exp, for the beam step: a radix select in
Triton (three passes over bf16 logits) plus small PyTorch glue. Reference: torch.topk and
torch.logsumexp.

Why: a beam step takes the top 2W of V = 151,936 logits for each of the B*W beams.
- PyTorch's topk takes 0.16 ms per step for 100 beams and 0.95 ms for 800 (bench/RESULTS.md),
  about 20 times the time to read the logits.
- The log-sum-exp is another 55 µs at 100 beams.
- Together they are the largest cost of a beam call that grows with the prompts in it.

How: each value's bit pattern is mapped to an integer key with the same order (16 bits for bf16,
32 for fp32). The key's bytes are then selected from the most significant down.
- Each byte pass is a Triton kernel over (row, split of the vocabulary): a histogram of that byte
  among the keys whose higher bytes equal the row's prefix so far. The first pass also folds
  each split's max and sum of exp, so the log-sum-exp comes for free.
- Between passes, PyTorch finds the byte value that holds the k-th largest key and extends the
  prefix.
- After the last pass the prefix is tau, the exact k-th largest key. A gather pass writes every
  key above tau, then the first keys equal to tau in index order until k are filled. Ties are
  broken by index, so the result is deterministic.

bf16 logits take two byte passes and the gather; fp32 takes four. The k values come back
unsorted: the keys above tau in index order, then the ties.

Status: checked against torch.topk in Triton's CPU interpreter (tests/test_triton_kernels.py),
and on the H200 by tests/test_gpu.py and bench.kernels_bench. It is opt-in (`--topk triton` in
the archiver) until an H200 run shows it beats torch.topk + logsumexp in the served beam graph.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BYTE = 256  # byte values; the histograms have 512 bins, keys that do not count go to the upper half
_IGNORE = tl.constexpr(256)


@triton.jit
def _keys(x):
    """int64 keys whose order is the order of the values: 16 bits for bf16, 32 for fp32."""
    if x.dtype == tl.bfloat16:
        u = x.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
        key = tl.where(u >= 0x8000, 0xFFFF - u, u | 0x8000)
    else:
        u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u | 0x80000000)
    return key


@triton.jit
def _byte_pass(x_ptr, prefix_ptr, hist_ptr, max_ptr, sum_ptr, vocab, stride_x, SHIFT: tl.constexpr,
               FIRST: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of key byte (key >> SHIFT) & 255 over the keys whose higher bytes equal the row's
    prefix (all keys on the FIRST pass, which also folds the split's max and sum of exp)."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if not FIRST:
        prefix = tl.load(prefix_ptr + row)
    hist = tl.zeros([2 * _IGNORE], tl.int32)
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    for off in range(0, SPLIT, BLOCK):
        cols = split * SPLIT + off + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf"))
        key = _keys(x)
        if FIRST:
            take = ok
            xf = x.to(tl.float32)
            m_new = tl.maximum(m, tl.max(xf, 0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no NaN from -inf - -inf
            s = s * tl.exp(m - ref) + tl.sum(tl.exp(xf - ref), 0)
            m = m_new
        else:
            take = ok & ((key >> (SHIFT + 8)) == prefix)
        # Keys that do not count land in bins 256..511 by their own byte, not all in one bin: a
        # histogram lowered to shared-memory atomics would serialise on a single hot bin.
        byte = ((key >> SHIFT) & 0xFF).to(tl.int32)
        hist += tl.histogram(tl.where(take, byte, byte + _IGNORE), 2 * _IGNORE)
    out = row * tl.num_programs(1) + split
    tl.store(hist_ptr + out * 2 * _IGNORE + tl.arange(0, 2 * _IGNORE), hist)
    if FIRST:
        tl.store(max_ptr + out + tl.arange(0, 1), m)
        tl.store(sum_ptr + out + tl.arange(0, 1), s)


@triton.jit
def _gather_pass(x_ptr, tau_ptr, above_ptr, need_ptr, base_gt_ptr, base_eq_ptr, val_ptr, idx_ptr, vocab,
                 stride_x, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    at = row * tl.num_programs(1) + split
    tau = tl.load(tau_ptr + row)  # the k-th largest key
    above = tl.load(above_ptr + row)  # keys > tau in the whole row: the ties are written after them
    need = tl.load(need_ptr + row)  # how many ties (keys == tau) the row takes
    next_gt = tl.load(base_gt_ptr + at)  # this split's first output slot for keys > tau
    next_eq = tl.load(base_eq_ptr + at)  # how many ties the splits before this one hold
    for off in range(0, SPLIT, BLOCK):
        cols = split * SPLIT + off + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        key = _keys(x)
        gt = ok & (key > tau)
        eq = ok & (key == tau)
        slot_gt = next_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        tie = next_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take_eq = eq & (tie < need)
        slot = tl.where(gt, slot_gt, above + tie)
        write = gt | take_eq
        tl.store(val_ptr + row * K + slot, x, mask=write)
        tl.store(idx_ptr + row * K + slot, cols.to(tl.int64), mask=write)
        next_gt += tl.sum(gt.to(tl.int32), 0)
        next_eq += tl.sum(eq.to(tl.int32), 0)


def _threshold(hist: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [R, 256] counts per byte value; k [R] ranks. The byte b holding the k-th largest (the
    largest b with at least k counts at b or above) and the count strictly above b."""
    at_or_above = hist.flip(-1).cumsum(-1).flip(-1)  # [R, 256]
    b = (at_or_above >= k[:, None]).sum(-1) - 1
    padded = torch.cat([at_or_above, at_or_above.new_zeros(hist.shape[0], 1)], 1)
    return b, padded.gather(1, (b + 1)[:, None])[:, 0]


@triton_op("slm::vocab_topk", mutates_args={})  # exports into AOTInductor graphs
def vocab_topk(logits: torch.Tensor, k: int, block: int = 2048, splits: int = 16,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] bf16 or fp32. Returns the k largest values per row [R, k] (logits' dtype,
    unsorted), their column ids [R, k] int64, and logsumexp [R] fp32."""
    rows, vocab = logits.shape
    if not 1 <= k <= vocab or logits.stride(1) != 1 or logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"vocab_topk: unsupported k={k} for logits {tuple(logits.shape)} {logits.dtype}")
    split = triton.cdiv(triton.cdiv(vocab, block), splits) * block  # a whole number of blocks
    n_split = triton.cdiv(vocab, split)  # every split starts inside the row
    dev, grid = logits.device, (rows, n_split)
    split_max = torch.empty(rows, n_split, dtype=torch.float32, device=dev)
    split_sum = torch.empty(rows, n_split, dtype=torch.float32, device=dev)
    byte = torch.arange(BYTE, device=dev)
    need = torch.full((rows,), k, dtype=torch.int64, device=dev)  # of the k, still to place at or below the prefix
    gt = torch.zeros(rows, n_split, dtype=torch.int64, device=dev)  # keys above the prefix, per split
    prefix = need  # unused by the first pass
    bits = 16 if logits.dtype == torch.bfloat16 else 32
    for shift in range(bits - 8, -1, -8):  # radix select, most significant byte first
        hist = torch.empty(rows, n_split, 2 * BYTE, dtype=torch.int32, device=dev)
        wrap_triton(_byte_pass)[grid](logits, prefix, hist, split_max, split_sum, vocab, logits.stride(0),
                                      SHIFT=shift, FIRST=shift == bits - 8, SPLIT=split, BLOCK=block)
        counts = hist[:, :, :BYTE].to(torch.int64)  # [R, S, 256]
        b, above = _threshold(counts.sum(1), need)
        gt = gt + (counts * (byte > b[:, None, None])).sum(-1)
        need = need - above
        prefix = b if shift == bits - 8 else prefix * BYTE + b
    ties = counts.gather(2, b[:, None, None].expand(rows, n_split, 1))[..., 0]  # [R, S] keys == prefix
    values = torch.empty(rows, k, dtype=logits.dtype, device=dev)
    ids = torch.empty(rows, k, dtype=torch.int64, device=dev)
    wrap_triton(_gather_pass)[grid](
        logits, prefix, k - need, need, gt.cumsum(1) - gt, ties.cumsum(1) - ties, values, ids, vocab,
        logits.stride(0), K=k, SPLIT=split, BLOCK=block,
    )
    top = split_max.max(1).values
    top = torch.where(top.isneginf(), 0.0, top)  # a row of -inf: logsumexp -inf, as torch's
    lse = top + torch.log((split_sum * torch.exp(split_max - top[:, None])).sum(1))
    return values, ids, lse
