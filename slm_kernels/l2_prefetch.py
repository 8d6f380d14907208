"""Weights asked into L2 by a kernel's spare programs, for the GEMMs that follow it.

At W2's decode shapes the projections are latency-bound: cuBLAS reads a layer's weights at a third
of HBM's rate, and the kernels between the GEMMs (the attention above all) leave most SMs idle. A
kernel that takes `prefetch_programs` more programs gives them the weights of the GEMMs after it;
each program issues its share of asynchronous L2 prefetches and exits, so the kernel's own work
does not wait for them (bench.step_bench measures whether the GEMMs then run faster).

How (a constexpr):
- BULK: Hopper's bulk prefetch (cp.async.bulk.prefetch.L2), one instruction per CHUNK bytes;
- LINES: prefetch.global.L2::evict_last, one instruction per 128-byte line, kept in L2 ahead of
  other lines;
- LOADS: plain loads of each chunk's first and last element, for Triton's CPU interpreter (which
  runs no inline assembly): the addressing is the same, and a compiled kernel drops the loads.
"""

import os

import torch
import triton
import triton.language as tl

BULK, LINES, LOADS = 1, 2, 3
SLOTS = 4  # tensors one kernel can prefetch


@triton.jit
def _prefetch_tensor(ptr, numel, program, programs, HOW: tl.constexpr, LANES: tl.constexpr):
    """Program `program` of `programs` asks for chunks program*LANES.., a stride of programs*LANES
    apart, of the numel elements at ptr."""
    ELEM: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    CHUNK: tl.constexpr = 128 if HOW == LINES else 16384  # bytes per instruction
    STEP: tl.constexpr = CHUNK // ELEM
    chunks = tl.cdiv(numel, STEP)
    for first in range(program * LANES, chunks, programs * LANES):
        c = first + tl.arange(0, LANES)
        start = c.to(tl.int64) * STEP
        # bytes of each chunk, a multiple of 16 (bulk copies move 16-byte units); 0 past the end
        size = tl.where(c < chunks, (tl.minimum(numel - start, STEP) * ELEM) // 16 * 16, 0).to(tl.int32)
        if HOW == BULK:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r",
                [ptr + start, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        elif HOW == LINES:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r",
                [ptr + start, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            ok = size > 0
            tl.load(ptr + start, mask=ok)
            tl.load(ptr + tl.minimum(start + STEP, numel) - 1, mask=ok)


@triton.jit
def prefetch_l2(p0, n0, p1, n1, p2, n2, p3, n3, program, programs, HOW: tl.constexpr):
    """Program `program` of `programs` asks L2 for its share of up to four tensors (n = 0: none)."""
    LANES: tl.constexpr = 32
    if n0 > 0:
        _prefetch_tensor(p0, n0, program, programs, HOW, LANES)
    if n1 > 0:
        _prefetch_tensor(p1, n1, program, programs, HOW, LANES)
    if n2 > 0:
        _prefetch_tensor(p2, n2, program, programs, HOW, LANES)
    if n3 > 0:
        _prefetch_tensor(p3, n3, program, programs, HOW, LANES)


def prefetch_args(tensors: "list[torch.Tensor]", how: int) -> tuple[list, int]:
    """The kernel arguments (p0, n0, ... p3, n3) for up to SLOTS contiguous tensors, and the HOW to
    launch with: LOADS under Triton's interpreter, whatever was asked."""
    if not 1 <= len(tensors) <= SLOTS or any(not t.is_contiguous() for t in tensors):
        raise ValueError(f"prefetch: 1 to {SLOTS} contiguous tensors, got {len(tensors)}")
    if how not in (BULK, LINES, LOADS):
        raise ValueError(f"prefetch: how is BULK ({BULK}), LINES ({LINES}) or LOADS ({LOADS}), got {how}")
    args: list = []
    for i in range(SLOTS):
        t = tensors[i] if i < len(tensors) else None
        args += [tensors[0] if t is None else t, 0 if t is None else t.numel()]
    return args, LOADS if os.environ.get("TRITON_INTERPRET") == "1" else how
