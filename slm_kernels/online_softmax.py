"""The FP32 online-softmax update shared by the Triton attention kernels, and their launch options."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_block(s, v, m_i, l_i, acc):
    """Fold one block of scores s [M, N] (fp32, -inf where masked) and its values v [N, D] into the
    running max m_i [M], normaliser l_i [M] and unnormalised output acc [M, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


def launch_options(num_warps: int, num_stages: int) -> dict:
    """Launch keywords for a kernel call: none at Triton's defaults (4 warps, 3 stages), which is
    what the compiled graphs use; other values are for tuning runs (bench.kernels_bench)."""
    return {} if (num_warps, num_stages) == (4, 3) else {"num_warps": num_warps, "num_stages": num_stages}
