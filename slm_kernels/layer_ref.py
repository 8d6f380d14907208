"""Pure-PyTorch references of the per-layer steps between the GEMMs: RMSNorm; splitting the fused
QKV rows into heads, RMS-normalising q and k per head (Qwen3's QK-norm) and rotating them (RoPE);
SiLU(gate) * up, and that quantised to E4M3 with one static scale (fp8-static's down-projection
input). They
define the interfaces slm_kernels/qkv_rope.py and slm_kernels/silu_mul.py implement, and are the path the
reference graphs run. The arithmetic is transformers': RMSNorm normalises in
FP32, rounds to the model dtype and scales by the weight in the model dtype; RoPE is
q * cos + rotate_half(q) * sin in the model dtype; the MLP is silu(gate) * up in the model dtype.
"""

import torch
import torch.nn.functional as F


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: x itself where it already is, as .to() gives it, but with nothing traced. A
    .to() that changes nothing still exports as two graph nodes, which an fp32 beam graph of 30
    layers holds about 1,800 of, each traced again and lowered by AOTInductor."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers computes it."""
    xf = as_dtype(x, torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * as_dtype(xf, x.dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] in x's dtype. Half-split RoPE (rotate_half)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qkv_rope_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (heads + 2 kv_heads) * D], q then k then v; cos, sin: [T, D] (each row's two
    halves equal, as the model's tables are). q_weight / k_weight: [D] QK-norm weights, or None
    (no QK-norm). Returns q [T, heads, D] and k [T, kv_heads, D] normalised and rotated, and
    v [T, kv_heads, D]."""
    d = cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin), v


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I], gate then up (the fused gate/up projection). Returns silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_static_ref(x: torch.Tensor, scale: "torch.Tensor | float") -> torch.Tensor:
    """x -> E4M3 with one FP32 scale fixed in advance (x ~ q * scale); values past E4M3's range
    saturate at its largest finite value."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def silu_mul_static_ref(gate_up: torch.Tensor, scale: "torch.Tensor | float") -> torch.Tensor:
    """silu_mul_ref then quantize_static_ref."""
    return quantize_static_ref(silu_mul_ref(gate_up), scale)
