"""The Triton kernels the graphs use, compiled for the H200 (sm_90) here on CPU: Triton's compiler
needs no GPU down to the cubin, so a kernel that would not compile fails here, not on the GPU
machine's next build. Shapes and constants as the graphs pass them (W1's Qwen3, W2/W3's Qwen2.5,
SmolLM2); a float argument both as fp32 and as fp64 (AOTInductor passes Python floats as fp64)."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, args: dict[str, str], constants: dict[str, object]) -> dict:
    """kernel compiled for sm_90: args maps each runtime argument, in order, to its Triton type;
    constants the constexpr ones. Returns the stages' code (ttir ... cubin)."""
    signature = {**args, **{name: "constexpr" for name in constants}}
    names = list(signature)
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=HOPPER).asm


@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
@pytest.mark.parametrize("group, head_dim", [(2, 128), (7, 64), (3, 64)])  # Qwen3-0.6B, Qwen2.5-0.5B, SmolLM2
def test_packed_attention_compiles_for_hopper(group, head_dim, float_type):
    from kernels.packed_attention import GROUPED_ROWS, _packed_attention_kernel

    pad = triton.next_power_of_2(group)
    args = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", cu_ptr="*i32", scale=float_type,
                **{f"stride_{n}": "i32" for n in ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh")})
    asm = compile_for_hopper(_packed_attention_kernel, args, dict(
        GROUP=group, GROUP_PAD=pad, HEAD_DIM=head_dim, BLOCK_M=GROUPED_ROWS // pad, BLOCK_N=4096 // head_dim))
    assert asm["cubin"]


@pytest.mark.parametrize("static, float_type", [(False, "fp32"), (True, "fp32"), (True, "fp64")])
def test_silu_mul_compiles_for_hopper(static, float_type):
    from kernels.silu_mul import _silu_mul_kernel

    args = dict(x_ptr="*bf16", out_ptr="*fp8e4nv" if static else "*bf16", scale=float_type, inner="i32",
                stride_x="i32", stride_out="i32")
    assert compile_for_hopper(_silu_mul_kernel, args, dict(BLOCK=1024, STATIC=static))["cubin"]
