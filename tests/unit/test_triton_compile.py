"""The Triton kernels the graphs use, compiled for the H200 (sm_90) here on CPU: Triton's compiler
needs no GPU down to the cubin, so a kernel that would not compile fails here, not on the GPU
machine's next build. Constants as the graphs pass them for W1's Qwen3-0.6B, W2/W3's Qwen2.5-0.5B
and SmolLM2; floats both as fp32 and as fp64 (AOTInductor passes Python floats as fp64)."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
FLOATS = ("scale", "eps")  # the kernels' float arguments; every other non-pointer one is an int


def compile_for_hopper(kernel, constants: dict, pointers: dict | None = None, float_type: str = "fp32") -> dict:
    """kernel compiled for sm_90 with these constexprs; pointers: a type per pointer argument
    other than bf16 (by name). Returns the stages' code (ttir ... cubin)."""
    pointers = pointers or {}
    signature = {
        name: "constexpr"
        if name in constants
        else pointers.get(name, "*bf16")
        if name.endswith("_ptr")
        else float_type
        if name in FLOATS
        else "i32"
        for name in kernel.arg_names
    }
    names = list(signature)
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(name),): value for name, value in constants.items()}
    )
    return triton.compile(source, target=HOPPER).asm


@pytest.mark.parametrize("float_type", ["fp32", "fp64"])
@pytest.mark.parametrize("group, head_dim", [(2, 128), (7, 64), (3, 64)])  # Qwen3-0.6B, Qwen2.5-0.5B, SmolLM2
def test_attention_kernels_compile_for_hopper(group, head_dim, float_type):
    from slm_kernels.packed_attention import GROUPED_ROWS, _packed_attention_kernel
    from slm_kernels.prefix_attention import _prefix_attention_kernel

    pad = triton.next_power_of_2(group)
    heads = dict(GROUP=group, GROUP_PAD=pad, HEAD_DIM=head_dim)
    i32 = {"cu_ptr": "*i32"}
    assert compile_for_hopper(
        _packed_attention_kernel, dict(heads, BLOCK_M=GROUPED_ROWS // pad, BLOCK_N=4096 // head_dim), i32, float_type
    )["cubin"]
    for suffix in (0, 4):  # a prefill's last layer (no suffix); the last decode step of 5 new tokens
        decode = dict(heads, BLOCK_W=64 // pad, BLOCK_N=64, SUFFIX=suffix)
        assert compile_for_hopper(_prefix_attention_kernel, decode, i32, float_type)["cubin"]


@pytest.mark.parametrize("heads, kv_heads, head_dim, norm", [(16, 8, 128, True), (14, 2, 64, False), (9, 3, 64, False)])
def test_qkv_rope_compiles_for_hopper(heads, kv_heads, head_dim, norm):
    from slm_kernels.qkv_rope import _qkv_rope_kernel

    p2 = triton.next_power_of_2
    constants = dict(
        HEADS=heads,
        HEADS_PAD=p2(heads),
        KV_HEADS=kv_heads,
        KV_PAD=p2(kv_heads),
        HEAD_DIM=head_dim,
        V_PAD=p2(kv_heads * head_dim),
        NORM=norm,
    )
    for float_type in ("fp32", "fp64"):
        assert compile_for_hopper(_qkv_rope_kernel, constants, float_type=float_type)["cubin"]


@pytest.mark.parametrize("static, float_type", [(False, "fp32"), (True, "fp32"), (True, "fp64")])
def test_silu_mul_kernels_compile_for_hopper(static, float_type):
    from slm_kernels.silu_mul import _silu_mul_kernel

    out = {"out_ptr": "*fp8e4nv" if static else "*bf16"}
    assert compile_for_hopper(_silu_mul_kernel, dict(BLOCK=1024, STATIC=static), out, float_type)["cubin"]


def test_vocab_topk_compiles_for_hopper():
    from slm_kernels.vocab_topk import _group_max_pass

    stats = {"bmax_ptr": "*fp32", "bsum_ptr": "*fp32"}
    assert compile_for_hopper(_group_max_pass, dict(GROUP=32, GROUPS=64), stats)["cubin"]  # the graphs' group


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])  # each beam's groups and logits; a prompt's continuations
def test_row_topk_compiles_for_hopper(dtype):
    from slm_kernels.row_topk import _row_topk_kernel

    for has_ids in (False, True):  # a row's first level, and the next ones over a level's candidates
        pointers = {"x_ptr": dtype, "values_ptr": dtype, "ids_ptr": "*i64", "out_ids_ptr": "*i64"}
        assert compile_for_hopper(_row_topk_kernel, dict(HAS_IDS=has_ids, BLOCK=8192), pointers)["cubin"]
