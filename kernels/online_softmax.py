"""The FP32 online-softmax update shared by the Triton attention kernels."""

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
