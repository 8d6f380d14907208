"""Selective FP8 (slm_core.fp8, issue 7) on CPU: the E4M3 quantisation and linear against their
definitions, which modules each precision swaps, the engine in fp8 against bf16, the accuracy
gate, and an fp8 build compiled by AOTInductor against its eager graph. The speed is the H200's
to measure (test_gpu.py, bench)."""

import json

import pytest
import torch

from slm_core import SpecError
from slm_core.checkpoint import load_checkpoint
from kernels.layer_ref import E4M3_MAX
from kernels.layer_ref import quantize_rows_ref as quantize_rows
from kernels.layer_ref import quantize_static_ref
from slm_core.fp8 import (CALIBRATION_TEXTS, STATIC_HEADROOM, Fp8Linear, Fp8MLP, StaticFp8Linear, StaticFp8MLP, calibrate,
                          quantize_linears, static_linears)
from slm_core.spec import TaskSpec
from test_hf_equality import engine_for

SCORE = dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32)
BEAM = dict(task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=24)


def test_rows_quantise_to_e4m3_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(6, 128) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0
    q, scale = quantize_rows(x.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    back = q.float() * scale[:, None]
    xb = x.bfloat16().float()
    assert torch.equal(back.abs().amax(1)[[0, 1, 3, 4, 5]], xb.abs().amax(1)[[0, 1, 3, 4, 5]])  # the max is exact
    # E4M3 keeps 3 mantissa bits: half a step is 1/16 of the value; below 2^-6 (subnormal) a fixed 2^-10
    assert ((back - xb).abs() <= xb.abs() / 16 + scale[:, None] * 2**-10).all()
    assert torch.equal(back[2], torch.zeros(128)) and (q.float().abs() <= E4M3_MAX).all()


def test_fp8_linear_is_the_scaled_product_of_its_quantised_operands():
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(64, 96, bias=bias).bfloat16()
        fp8 = Fp8Linear(linear)
        x = torch.randn(14, 64).bfloat16()
        y = fp8(x)
        assert y.shape == (14, 96) and y.dtype == torch.bfloat16 and fp8.weight.dtype == torch.float8_e4m3fn
        qx, sx = quantize_rows(x)
        want = (qx.float() * sx[:, None]) @ (fp8.weight.float() * fp8.weight_scale[:, None]).t()
        if bias:
            want = want + linear.bias.float()
        torch.testing.assert_close(y.float(), want, atol=0.02, rtol=0.01)  # bf16 output rounding
        ref = linear(x).float()
        assert (y.float() - ref).norm() / ref.norm() < 0.08  # E4M3 on both sides: a few % of the product


def test_the_fp8_mlp_is_its_linears_composed_and_refuses_odd_widths():
    """Fp8MLP (padding row carried through, SiLU·up quantised in one step) answers exactly as
    Fp8Linear(gate_up) -> SiLU·up -> Fp8Linear(down) one by one."""
    from kernels.layer_ref import silu_mul_quant_ref, silu_mul_ref

    torch.manual_seed(0)
    mlp = torch.nn.Module()
    mlp.gate_up, mlp.down = torch.nn.Linear(64, 2 * 96).bfloat16(), torch.nn.Linear(96, 64).bfloat16()
    fused = Fp8MLP(mlp, silu_mul_quant_ref)
    for rows in (1, 5):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(fused(x), fused.down(silu_mul_ref(fused.gate_up(x))))
    with pytest.raises(SpecError, match="multiples of 16"):
        Fp8Linear(torch.nn.Linear(64, 100))


def test_static_fp8_linear_is_the_product_of_its_operands_and_saturates_past_its_range():
    """One scale per tensor: the weight's from its largest |value|, the input's fixed in advance
    (twice the calibrated largest |input|); an input already in E4M3 is taken as it is."""
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(64, 96, bias=bias).bfloat16()
        fp8 = StaticFp8Linear(linear, input_amax=3.0)
        assert fp8.input_scale.item() == pytest.approx(3.0 * STATIC_HEADROOM / E4M3_MAX)
        assert fp8.weight_scale.item() == pytest.approx(linear.weight.float().abs().max().item() / E4M3_MAX)
        x = torch.randn(14, 64).bfloat16()
        y = fp8(x)
        assert y.shape == (14, 96) and y.dtype == torch.bfloat16 and fp8.weight.dtype == torch.float8_e4m3fn
        qx = quantize_static_ref(x, fp8.input_scale)
        want = (qx.float() * fp8.input_scale) @ (fp8.weight.float() * fp8.weight_scale).t()
        if bias:
            want = want + linear.bias.float()
        torch.testing.assert_close(y.float(), want, atol=0.02, rtol=0.01)
        assert torch.equal(fp8(qx), y)  # already quantised: the same product
        ref = linear(x).float()
        assert (y.float() - ref).norm() / ref.norm() < 0.08
    # past twice the calibrated range an input saturates at E4M3's largest value
    big = torch.full((1, 64), 100.0).bfloat16()
    assert quantize_static_ref(big, fp8.input_scale).float().max().item() == E4M3_MAX
    with pytest.raises(SpecError, match="multiples of 16"):
        StaticFp8Linear(torch.nn.Linear(64, 100), 1.0)


def test_calibration_records_each_linear_input_and_fp8_static_swaps_qkv_and_the_mlp(random_checkpoint):
    """calibrate: the largest |input| of every qkv, gate/up and down over the calls it watches,
    read against hooks of our own; fp8-static swaps exactly those, with those input scales."""
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    engine = engine_for(ckpt, **SCORE, precision="bf16")
    model, texts = engine.graph.model, [["search engines rank documents"], ["a b c d e f g"]]
    seen = {}
    hooks = [lin.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, max(seen.get(m, 0.0), a[0].abs().max().item())))
             for lin in static_linears(model)]
    amax = calibrate(model, lambda: [engine.run_score_batch([t]) for t in texts])
    for h in hooks:
        h.remove()
    assert len(amax) == 3 * len(model.layers) and amax == seen and all(v > 0 for v in amax.values())
    qkv, gate_up, down = model.layers[1].attn.qkv, model.layers[1].mlp.gate_up, model.layers[1].mlp.down
    with pytest.raises(SpecError, match="needs calibrated input scales"):
        quantize_linears(model, "fp8-static")
    quantize_linears(model, "fp8-static", amax=amax)
    layer = model.layers[1]
    assert isinstance(layer.attn.qkv, StaticFp8Linear) and isinstance(layer.mlp, StaticFp8MLP)
    assert layer.attn.o.__class__ is torch.nn.Linear and model.lm_head.__class__ is torch.nn.Linear
    for module, swapped in ((qkv, layer.attn.qkv), (gate_up, layer.mlp.gate_up), (down, layer.mlp.down)):
        assert swapped.input_scale.item() == pytest.approx(amax[module] * STATIC_HEADROOM / E4M3_MAX)
    with pytest.raises(SpecError, match="no calibration text reached"):
        calibrate(engine_for(ckpt, **SCORE, precision="bf16").graph.model, lambda: None)
    assert len(CALIBRATION_TEXTS) >= 10


def test_each_precision_swaps_only_its_linears(random_checkpoint):
    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    for precision, mlp, head in (("bf16", False, False), ("fp8-mlp", True, False), ("fp8-mlp-lmhead", True, True)):
        model = engine_for(ckpt, **BEAM, precision="bf16").graph.model
        quantize_linears(model, precision)
        layer = model.layers[0]
        assert isinstance(layer.mlp, Fp8MLP) == mlp and isinstance(layer.mlp.gate_up, Fp8Linear) == mlp
        assert isinstance(model.lm_head, Fp8Linear) == head
        assert not isinstance(layer.attn.qkv, Fp8Linear) and model.embed.weight.dtype == torch.bfloat16
    with pytest.raises(SpecError, match="fp8-mlp-lmhead' is for beam tasks"):
        TaskSpec.from_dict({**SCORE, "precision": "fp8-mlp-lmhead"})


def test_fp8_engines_answer_close_to_bf16_and_the_gate_measures_it(random_checkpoint):
    """The fp8 graphs run end to end (score keeps its bf16 label rows, the beam's LM head in E4M3);
    the gate records how far they are from bf16 and refuses a build past its threshold."""
    from slm_core.package import fp8_gate, gate_passes
    from slm_core.spec import RuntimeSpec

    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    bf16, fp8 = engine_for(ckpt, **SCORE, precision="bf16"), engine_for(ckpt, **SCORE, precision="fp8-mlp")
    texts = ["search engines rank documents", "a", "the lazy dog " * 3]
    diffs = [abs(a - b) for r, s in zip(bf16.score(texts), fp8.score(texts)) for a, b in zip(r, s)]
    assert 0 < max(diffs) < 0.1
    assert torch.equal(fp8.graph.head_weight, bf16.graph.head_weight)
    gate = fp8_gate(ckpt, RuntimeSpec("cpu"), fp8, max_diff=0.1, min_shared=0.5)
    assert gate["against"] == "bf16" and 0 < gate["mean_abs_diff"] <= gate["max_abs_diff"] < 0.1 and gate["texts"] >= 10
    with pytest.raises(SpecError, match="fails its accuracy gate"):
        fp8_gate(ckpt, RuntimeSpec("cpu"), fp8, max_diff=gate["max_abs_diff"] / 2, min_shared=0.5)
    assert gate_passes(gate, max_diff=gate["max_abs_diff"]) and not gate_passes(gate, max_diff=gate["max_abs_diff"] / 2)

    static = engine_for(ckpt, **SCORE, precision="fp8-static")  # calibrated in build_graph
    assert isinstance(static.graph.model.layers[0].attn.qkv, StaticFp8Linear)
    diffs = [abs(a - b) for r, s in zip(bf16.score(texts), static.score(texts)) for a, b in zip(r, s)]
    assert 0 < max(diffs) < 0.1
    gate = fp8_gate(ckpt, RuntimeSpec("cpu"), static, max_diff=0.1, min_shared=0.5)
    assert 0 < gate["mean_abs_diff"] <= gate["max_abs_diff"] < 0.1

    beam = engine_for(ckpt, **BEAM, precision="fp8-mlp-lmhead")
    assert isinstance(beam.graph.model.lm_head, Fp8Linear)
    gate = fp8_gate(ckpt, RuntimeSpec("cpu"), beam, max_diff=0.1, min_shared=0.0)
    assert gate["prompts"] >= 3 and 0 <= gate["worst_prompt"] <= gate["shared_candidates"] <= 1
    with pytest.raises(SpecError, match="fails its accuracy gate"):
        fp8_gate(ckpt, RuntimeSpec("cpu"), beam, max_diff=0.1, min_shared=1.01)
    assert gate_passes(gate, min_shared=gate["shared_candidates"]) and not gate_passes(gate, min_shared=1.01)
    static = engine_for(ckpt, **BEAM, precision="fp8-static")  # calibrated on beam calls, decode steps included
    gate = fp8_gate(ckpt, RuntimeSpec("cpu"), static, max_diff=0.1, min_shared=0.0)
    assert gate["prompts"] >= 3 and 0 <= gate["worst_prompt"] <= gate["shared_candidates"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8-mlp", "fp8-static"])
def test_fp8_score_build_compiles_matches_eager_and_records_its_gate(random_checkpoint, tmp_path, precision):
    """An fp8 score package (AOTInductor, CPU): compiled equals eager, the manifest records the
    precision and the gate, and the served engine loads it (fp8-static: with the scales its build
    calibrated, as the eager graph calibrates them)."""
    from slm_core.package import MANIFEST, TOLERANCE, build_package, load_package

    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    task = TaskSpec.from_dict({**SCORE, "precision": precision})
    manifest = build_package(ckpt, task, "cpu", tmp_path / "pkg", fp8_max_diff=0.1)
    assert manifest == json.loads((tmp_path / "pkg" / MANIFEST).read_text())
    assert manifest["task"]["precision"] == precision and manifest["dtype"] == "bfloat16"
    assert manifest["fp8_gate"]["max_abs_diff"] < 0.1 and manifest["check"]["max_abs_diff"] <= 5e-2
    eager = engine_for(ckpt, **SCORE, precision=precision)
    texts = ["search engines rank documents", "a"]
    for row, ref in zip(load_package(tmp_path / "pkg").score(texts), eager.score(texts)):
        assert row == pytest.approx(ref, abs=TOLERANCE[precision])  # Inductor rounds a few values to the next E4M3 step
