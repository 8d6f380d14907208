"""Selective FP8 (E4M3) linears for Hopper (issues 6, 7). torch._scaled_mm multiplies E4M3
operands with their FP32 scales, output in the model's dtype. Which linears a precision quantises,
and how (the task's `precision`, recorded in the manifest):
- `fp8-mlp`: each layer's MLP, gate/up and down. Weights with one scale per output channel,
  inputs quantised per row (per token) on the fly;
- `fp8-mlp-lmhead`: those and the LM head (beam tasks; a score task computes only its label rows);
- `fp8-static`: each layer's qkv, gate/up and down, with one scale per tensor. The input scales
  are fixed at build: the largest |input| of each linear over CALIBRATION_TEXTS, run through
  the bf16 graph (calibrate), times STATIC_HEADROOM. So quantising an input is a multiply fused
  into the kernel that writes it, and the GEMM is cuBLAS's per-tensor FP8 one, ~1.4x bf16 at a W1
  request's 1,700 rows where the per-row one gains ~1.15x (bench/RESULTS.md, bench.gemm_bench).
  Inputs past the calibrated range saturate.
The o-projection, norms, attention, softmax, log-softmax and the beam's scores stay in bf16 / fp32.

The modules are swapped in after the bf16 weights are loaded (quantize_linears); the model's code
does not change. Where each input is quantised:
- gate/up: its input is the post-attention RMSNorm's output; Inductor compiles the norm and the
  quantisation (kernels.layer_ref, PyTorch) together;
- down: SiLU(gate)·up and the quantisation are one Triton kernel (kernels/silu_mul.py,
  silu_mul_quant); the product is never written in bf16;
- the LM head: its input quantised by Inductor after the final norm, as gate/up;
- fp8-static: qkv's and gate/up's inputs by Inductor with the norm before them, down's in the
  SiLU·up kernel (silu_mul_static).
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layer_ref import E4M3_MAX, quantize_rows_ref, quantize_static_ref, silu_mul_quant_ref, silu_mul_static_ref
from slm_core.errors import SpecError

FP8_LINEARS = {"fp8-mlp": ("mlp",), "fp8-mlp-lmhead": ("mlp", "lm_head")}  # per-row precisions: what they swap
STATIC = ("fp8-static",)  # the precisions whose input scales are calibrated at build (static_linears)
STATIC_HEADROOM = 2.0  # an input scale covers twice the largest |input| calibration saw
# fp8-static's calibration inputs: queries, reviews, product titles, instructions, a little code and
# numbers; none of them in slm_core.package's EVAL_TEXTS, on which the accuracy gate judges the build.
CALIBRATION_TEXTS = [
    "flights to lisbon next weekend",
    "does this blender crush ice? the reviews say it struggles with frozen fruit",
    "Men's waterproof hiking boots, size 44, brown leather, Vibram sole",
    "Summarise the following paragraph in one sentence: The committee met on Tuesday and agreed "
    "to postpone the vote until the budget figures for the third quarter are available.",
    "how many grams of protein are in 200 g of greek yogurt",
    "def add(a, b):\n    return a + b  # why does this fail with None?",
    "I ordered two of these and one arrived cracked. Customer service replaced it within a week.",
    "Order #48213: 3 x USB-C cable (2 m), 1 x wall charger 65 W, total 47.97 EUR",
    "what is the difference between a roth ira and a traditional ira",
    "Die Lieferung kam pünktlich, aber die Verpackung war beschädigt.",
    "best budget 4k monitor for photo editing 2024",
    "Translate to French: where is the nearest train station?",
]


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


class StaticFp8Linear(nn.Module):
    """nn.Linear with an E4M3 weight and one FP32 scale for it, and one for its input fixed in
    advance: y = (q_x s_x)(q_W s_W)^T + b. forward takes the input in the model dtype (quantised
    here) or already in E4M3 with this module's input_scale (silu_mul_static)."""

    def __init__(self, linear: nn.Linear, input_amax: float):
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise SpecError(f"an FP8 linear needs in and out features that are multiples of 16 (_scaled_mm), "
                            f"got {k} -> {n}: use precision bf16 for this model")
        w = linear.weight.detach()
        weight_scale = w.float().abs().amax().clamp_min(1e-12) / E4M3_MAX
        self.register_buffer("weight", quantize_static_ref(w, weight_scale))  # [N, K] row-major: .t() is column-major
        self.register_buffer("weight_scale", weight_scale)
        self.input_scale_value = max(input_amax, 1e-6) * STATIC_HEADROOM / E4M3_MAX  # for kernels that take a number
        self.register_buffer("input_scale", torch.tensor(self.input_scale_value, device=w.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x if x.dtype == torch.float8_e4m3fn else quantize_static_ref(x, self.input_scale)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                             out_dtype=self.out_dtype)
        return y if self.bias is None else y + self.bias


class StaticFp8MLP(nn.Module):
    """The MLP with StaticFp8Linear gate/up and down; SiLU·up comes out in E4M3 at down's input
    scale (silu_mul_static: the Triton kernel or its reference)."""

    def __init__(self, mlp: nn.Module, amax: dict[nn.Module, float], silu_mul_static: Callable):
        super().__init__()
        self.gate_up = StaticFp8Linear(mlp.gate_up, amax[mlp.gate_up])
        self.down = StaticFp8Linear(mlp.down, amax[mlp.down])
        self.silu_mul_static = silu_mul_static

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.silu_mul_static(self.gate_up(x), self.down.input_scale_value))


def static_linears(model: nn.Module) -> list[nn.Linear]:
    """The linears fp8-static quantises: each layer's qkv, gate/up and down."""
    return [lin for layer in model.layers for lin in (layer.attn.qkv, layer.mlp.gate_up, layer.mlp.down)]


@torch.no_grad()
def calibrate(model: nn.Module, run: Callable[[], None]) -> dict[nn.Module, float]:
    """The largest |input| of each of static_linears(model) while `run` calls the model (its bf16
    graph, eager, on CALIBRATION_TEXTS)."""
    amax: dict[nn.Module, float] = {}

    def record(module, args):
        amax[module] = max(amax.get(module, 0.0), args[0].detach().abs().amax().item())

    hooks = [lin.register_forward_pre_hook(record) for lin in static_linears(model)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    if len(amax) != len(hooks):
        raise SpecError("fp8-static calibration: no calibration text reached every linear (do the task bounds "
                        "admit any of slm_core.fp8.CALIBRATION_TEXTS?)")
    return amax


def quantize_linears(model: nn.Module, precision: str, triton: bool = False,
                     amax: dict[nn.Module, float] | None = None) -> None:
    """Swap in the FP8 modules `precision` names (FP8_LINEARS; STATIC: static_linears), in place; bf16/fp32: none. With
    `triton`, the MLP's SiLU·up + quantisation is the Triton kernel (CUDA), else the reference.
    fp8-static needs the inputs' calibrated `amax` (calibrate)."""
    parts = FP8_LINEARS.get(precision, ())
    if precision in STATIC:
        if amax is None:
            raise SpecError(f"precision {precision} needs calibrated input scales (slm_core.fp8.calibrate)")
        if triton:
            from kernels.silu_mul import silu_mul_static
        else:
            silu_mul_static = silu_mul_static_ref
        for layer in model.layers:
            layer.attn.qkv = StaticFp8Linear(layer.attn.qkv, amax[layer.attn.qkv])
            layer.mlp = StaticFp8MLP(layer.mlp, amax, silu_mul_static)
        return
    if "mlp" in parts:
        if triton:
            from kernels.silu_mul import silu_mul_quant
        else:
            silu_mul_quant = silu_mul_quant_ref
        for layer in model.layers:
            layer.mlp = Fp8MLP(layer.mlp, silu_mul_quant)
    if "lm_head" in parts:
        model.lm_head = Fp8Linear(model.lm_head)
