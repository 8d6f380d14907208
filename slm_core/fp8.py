"""Selective FP8 (E4M3) linears for Hopper (issue 7): the weights of the chosen linears are stored
in E4M3 with one FP32 scale per output channel; their input is quantised per row (per token) to
E4M3 on the fly, and torch._scaled_mm multiplies with both scales, output in the model's dtype.

Which linears a precision quantises (the task's `precision`, recorded in the manifest):
- `fp8-mlp`: each layer's MLP, gate/up and down;
- `fp8-mlp-lmhead`: those and the LM head (beam tasks; a score task computes only its label rows).
Attention projections, norms, softmax, log-softmax and the beam's scores stay in bf16 / fp32.

The modules are swapped in after the bf16 weights are loaded (quantize_linears); the model's code
does not change. Where each input is quantised:
- gate/up: its input is the post-attention RMSNorm's output; Inductor compiles the norm and the
  quantisation (kernels.layer_ref, PyTorch) together;
- down: SiLU(gate)·up and the quantisation are one Triton kernel (kernels/silu_mul.py,
  silu_mul_quant); the product is never written in bf16;
- the LM head: its input quantised by Inductor after the final norm, as gate/up.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layer_ref import quantize_rows_ref, silu_mul_quant_ref
from slm_core.errors import SpecError

FP8_LINEARS = {"fp8-mlp": ("mlp",), "fp8-mlp-lmhead": ("mlp", "lm_head")}


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with one zero row more. _scaled_mm tells per-row from per-tensor scales by their
    count, so a lone row would make torch.export guard on M != 1 (a text or prompt of one token);
    with the row it never is 1. Inductor writes the row within the quantisation pass."""
    return F.pad(x, (0, 0, 0, 1))


class Fp8Linear(nn.Module):
    """nn.Linear with an E4M3 weight (per-output-channel FP32 scales) and per-row dynamic E4M3
    activations: y = (q_x s_x)(q_W s_W)^T + b, accumulated in FP32 by torch._scaled_mm."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise SpecError(f"an FP8 linear needs in and out features that are multiples of 16 (_scaled_mm), "
                            f"got {k} -> {n}: use precision bf16 for this model")
        weight, scale = quantize_rows_ref(linear.weight.detach())
        self.register_buffer("weight", weight)  # [N, K] E4M3, row-major: its .t() is the column-major B
        self.register_buffer("weight_scale", scale)  # [N] fp32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype

    def mm(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """E4M3 rows [M, K] and their FP32 scales [M] (M >= 2, _padded) -> [M, N]."""
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale[:, None], scale_b=self.weight_scale[None, :],
                             out_dtype=self.out_dtype)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        return self.mm(*quantize_rows_ref(_padded(x)))[:-1]


class Fp8MLP(nn.Module):
    """The MLP with E4M3 gate/up and down. The padding row rides through both products, and
    SiLU(gate)·up comes out quantised (silu_mul_quant: the Triton kernel or its reference)."""

    def __init__(self, mlp: nn.Module, silu_mul_quant):
        super().__init__()
        self.gate_up, self.down = Fp8Linear(mlp.gate_up), Fp8Linear(mlp.down)
        self.silu_mul_quant = silu_mul_quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up.mm(*quantize_rows_ref(_padded(x)))  # [M + 1, 2I]
        return self.down.mm(*self.silu_mul_quant(h))[:-1]


def quantize_linears(model: nn.Module, precision: str, triton: bool = False) -> None:
    """Swap in the FP8 modules `precision` names (FP8_LINEARS), in place; bf16/fp32: none. With
    `triton`, the MLP's SiLU·up + quantisation is the Triton kernel (CUDA), else the reference."""
    parts = FP8_LINEARS.get(precision, ())
    if "mlp" in parts:
        if triton:
            from kernels.silu_mul import silu_mul_quant
        else:
            silu_mul_quant = silu_mul_quant_ref
        for layer in model.layers:
            layer.mlp = Fp8MLP(layer.mlp, silu_mul_quant)
    if "lm_head" in parts:
        model.lm_head = Fp8Linear(model.lm_head)
