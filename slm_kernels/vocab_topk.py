"""Exact row-wise top-k of logits and their log-sum-exp, for the beam step: one Triton pass over
the logits (each group's maximum and the row's log-sum-exp), then PyTorch's top-k over what is
left. Reference: torch.topk and torch.logsumexp.

Why: a beam step takes the top 2W of V = 151,936 logits for each of the B*W beams.
- PyTorch's topk over whole rows takes many times the time to read the logits.
- The log-sum-exp is another read of the logits.
- Together they are the largest cost of a beam call that grows with the prompts in it.

How: cut each row into groups of G consecutive columns.
1. One Triton pass reads the row once and writes each group's maximum, and per block of groups
   the maximum and the sum of exp, from which the row's log-sum-exp follows.
2. torch.topk picks the k groups with the largest maxima: a row of V / G values, not V.
3. torch.topk picks the k largest of those groups' k * G logits.

Step 3 returns the row's exact top k values. Every value above the row's k-th largest, tau, lies
in a chosen group: were its group left out, the k chosen groups' maxima would be k more values
above tau. And at least k values >= tau are among the chosen groups: either every chosen maximum
is >= tau (k of them), or some is below tau, and then every group holding a value >= tau was
chosen. Which of several equal values is taken follows torch.topk (any order, as torch.topk's
own tie order). The k values come back unsorted.

Steps 2 and 3 stay torch.topk: slm_kernels.row_topk, faster at the step's other selections, is
faster here at 100 rows but slower at 800 (bench/RESULTS.md).

It is faster than torch.topk + logsumexp at every beam count (bench.kernels_bench): the beam
graphs use it on CUDA (RuntimeSpec kernels "triton"); torch.topk is its test oracle and the CPU
path.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _group_max_pass(
    x_ptr, gmax_ptr, bmax_ptr, bsum_ptr, vocab, n_groups, stride_x, GROUP: tl.constexpr, GROUPS: tl.constexpr
):
    """Program (row, block): GROUPS groups of GROUP columns. Writes each group's maximum, and the
    block's maximum and sum of exp(x - maximum)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    group = block * GROUPS + tl.arange(0, GROUPS)
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf"))
    top = tl.max(x, axis=1)
    tl.store(gmax_ptr + row * n_groups + group, top, mask=group < n_groups)
    xf = x.to(tl.float32)
    m = tl.max(tl.max(xf, axis=1), axis=0)
    ref = tl.where(m == float("-inf"), 0.0, m)  # all -inf: a sum of 0, no NaN from -inf - -inf
    at = row * tl.num_programs(1) + block
    tl.store(bmax_ptr + at, m)
    tl.store(bsum_ptr + at, tl.sum(tl.sum(tl.exp(xf - ref), axis=1), axis=0))


@triton_op("slm::vocab_topk", mutates_args={})  # exports into AOTInductor graphs
def vocab_topk(
    logits: torch.Tensor,
    k: int,
    group: int = 32,
    block: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] bf16 or fp32. Returns the k largest values per row [R, k] (logits' dtype,
    unsorted), their column ids [R, k] int64, and logsumexp [R] fp32. `group` (a power of two) is
    lowered until the row has at least k groups; `block` columns go to one program."""
    rows, vocab = logits.shape
    if not 1 <= k <= vocab or logits.stride(1) != 1 or logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"vocab_topk: unsupported k={k} for logits {tuple(logits.shape)} {logits.dtype}")
    while group > 1 and triton.cdiv(vocab, group) < k:
        group //= 2
    n_groups = triton.cdiv(vocab, group)
    groups = max(1, min(block // group, triton.next_power_of_2(n_groups)))  # groups per program
    n_blocks = triton.cdiv(n_groups, groups)
    dev = logits.device
    gmax = torch.empty(rows, n_groups, dtype=logits.dtype, device=dev)
    bmax = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev)
    bsum = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev)
    wrap_triton(_group_max_pass)[(rows, n_blocks)](
        logits, gmax, bmax, bsum, vocab, n_groups, logits.stride(0), GROUP=group, GROUPS=groups
    )
    chosen = gmax.topk(k, dim=1, sorted=False).indices  # [R, k] groups
    cols = (chosen[:, :, None] * group + torch.arange(group, device=dev)).flatten(1)  # [R, k * group]
    values = logits.gather(1, cols.clamp_max(vocab - 1)).masked_fill(cols >= vocab, float("-inf"))
    values, at = values.topk(k, dim=1, sorted=False)
    top = bmax.max(1).values
    top = torch.where(top.isneginf(), 0.0, top)  # a row of -inf: logsumexp -inf, as torch's
    lse = top + torch.log((bsum * torch.exp(bmax - top[:, None])).sum(1))
    # A partial last group's columns past the row are -inf stand-ins; only a row with fewer than k
    # values above -inf can take one, and its id is clamped into the row (a -inf logit there too).
    return values, cols.gather(1, at).clamp_max(vocab - 1), lse
