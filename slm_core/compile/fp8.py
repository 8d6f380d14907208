"""fp8-static (precision `fp8-static`): each layer's qkv, gate/up and down projections in E4M3
with one FP32 scale per tensor, for Hopper. cuBLAS's per-tensor FP8 GEMM is ~1.4x bf16 at a W1
request's ~1,700 rows, where per-row scales gain ~1.15x (bench.gemm_bench).

- The weight scale is the tensor's largest |value|.
- The input scales are fixed at build: calibrate runs the bf16 graph on CALIBRATION_TEXTS, and each
  input scale covers STATIC_HEADROOM times the largest |input| seen; larger inputs saturate. So
  quantising an input is a multiply inside the kernel that writes it: Inductor's norm before qkv
  and gate/up, the SiLU·up kernel before down (slm_kernels/silu_mul.py, silu_mul_static).
- The o-projection, norms, attention, softmax, log-softmax and the heads stay bf16 / fp32: the
  o-projection in E4M3 per tensor fails the accuracy gate on the W1 model.

The modules are swapped in after the bf16 weights are loaded (quantize_linears): the model's code
does not change.
"""

from collections.abc import Callable

import torch
from torch import nn

from slm_core.errors import SpecError
from slm_kernels.layer_ref import E4M3_MAX, quantize_static_ref, silu_mul_static_ref

STATIC_HEADROOM = 2.0  # an input scale covers twice the largest |input| calibration saw
# Calibration inputs: queries, reviews, product titles, instructions, a little code and numbers;
# none of them among slm_core.compile.checks.EVAL_TEXTS, on which the accuracy gate judges the build.
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


class StaticFp8Linear(nn.Module):
    """nn.Linear with an E4M3 weight and one FP32 scale for it, and one for its input fixed in
    advance: y = (q_x s_x)(q_W s_W)^T + b. forward takes the input in the model dtype (quantised
    here) or already in E4M3 with this module's input_scale (silu_mul_static)."""

    def __init__(self, linear: nn.Linear, input_amax: float):
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise SpecError(
                f"an FP8 linear needs in and out features that are multiples of 16 (_scaled_mm), "
                f"got {k} -> {n}: use precision bf16 for this model"
            )
        w = linear.weight.detach()
        weight_scale = w.float().abs().amax().clamp_min(1e-12) / E4M3_MAX
        self.register_buffer("weight", quantize_static_ref(w, weight_scale))  # [N, K] row-major: .t() is column-major
        self.register_buffer("weight_scale", weight_scale)
        # A number for kernels: AOTInductor folds a 0-dim constant tensor into a value a Triton
        # kernel's signature cannot take.
        self.input_scale_value = max(input_amax, 1e-6) * STATIC_HEADROOM / E4M3_MAX
        self.register_buffer("input_scale", torch.tensor(self.input_scale_value, device=w.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x if x.dtype == torch.float8_e4m3fn else quantize_static_ref(x, self.input_scale)
        y = torch._scaled_mm(
            q, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale, out_dtype=self.out_dtype
        )
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
        raise SpecError(
            "fp8-static calibration: no calibration text reached every linear (do the task bounds "
            "admit any of slm_core.compile.fp8.CALIBRATION_TEXTS?)"
        )
    return amax


def quantize_linears(model: nn.Module, amax: dict[nn.Module, float], triton: bool = False) -> None:
    """Swap in the E4M3 qkv and MLPs, in place, with the calibrated input ranges `amax`; with
    `triton`, SiLU·up and its quantisation are the Triton kernel (CUDA), else the reference."""
    if triton:
        from slm_kernels.silu_mul import silu_mul_static
    else:
        silu_mul_static = silu_mul_static_ref
    for layer in model.layers:
        layer.attn.qkv = StaticFp8Linear(layer.attn.qkv, amax[layer.attn.qkv])
        layer.mlp = StaticFp8MLP(layer.mlp, amax, silu_mul_static)
