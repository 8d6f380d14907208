"""fp8-static (slm_core.compile.fp8) on CPU: the E4M3 linear against its definition, calibration and
which modules it swaps, the engine in fp8 against bf16, the accuracy gate, and an fp8 build
compiled by AOTInductor against its eager graph. The speed is the H200's to measure (tests/gpu,
bench)."""

import json

import pytest
import torch
from helpers import engine_for

from slm_core import Engine, SpecError
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.compile.checks import GateThresholds, fp8_gate
from slm_core.compile.fp8 import (
    CALIBRATION_TEXTS,
    STATIC_HEADROOM,
    StaticFp8Linear,
    StaticFp8MLP,
    calibrate,
    quantize_linears,
    static_linears,
)
from slm_core.spec import TaskSpec
from slm_kernels.layer_ref import E4M3_MAX, quantize_static_ref

SCORE = dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32)
BEAM = dict(task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=24)


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
    hooks = [
        lin.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, max(seen.get(m, 0.0), a[0].abs().max().item())))
        for lin in static_linears(model)
    ]
    amax = calibrate(model, lambda: [engine.run([t]) for t in texts])
    for h in hooks:
        h.remove()
    assert len(amax) == 3 * len(model.layers) and amax == seen and all(v > 0 for v in amax.values())
    qkv, gate_up, down = model.layers[1].attn.qkv, model.layers[1].mlp.gate_up, model.layers[1].mlp.down
    quantize_linears(model, amax)
    layer = model.layers[1]
    assert isinstance(layer.attn.qkv, StaticFp8Linear) and isinstance(layer.mlp, StaticFp8MLP)
    assert layer.attn.o.__class__ is torch.nn.Linear and model.lm_head.__class__ is torch.nn.Linear
    for module, swapped in ((qkv, layer.attn.qkv), (gate_up, layer.mlp.gate_up), (down, layer.mlp.down)):
        assert swapped.input_scale.item() == pytest.approx(amax[module] * STATIC_HEADROOM / E4M3_MAX)
    with pytest.raises(SpecError, match="no calibration text reached"):
        calibrate(engine_for(ckpt, **SCORE, precision="bf16").graph.model, lambda: None)
    assert len(CALIBRATION_TEXTS) >= 10


def test_fp8_static_engines_answer_close_to_bf16_and_the_gate_measures_it(random_checkpoint):
    """fp8-static runs end to end, calibrated in build_graph (score keeps its bf16 label rows;
    beam calibrates on its decode steps too); the gate records how far it is from bf16 and
    refuses a build past its threshold."""
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    bf16, static = engine_for(ckpt, **SCORE, precision="bf16"), engine_for(ckpt, **SCORE, precision="fp8-static")
    assert isinstance(static.graph.model.layers[0].attn.qkv, StaticFp8Linear)
    assert torch.equal(static.graph.head_weight, bf16.graph.head_weight)
    texts = ["search engines rank documents", "a", "the lazy dog " * 3]
    diffs = [abs(a - b) for r, s in zip(bf16.score(texts), static.score(texts)) for a, b in zip(r, s)]
    assert 0 < max(diffs) < 0.1
    gate = fp8_gate(bf16, static, GateThresholds(max_diff=0.1))
    assert gate["against"] == "bf16" and 0 < gate["mean_abs_diff"] <= gate["max_abs_diff"] < 0.1 and gate["texts"] >= 10
    with pytest.raises(SpecError, match="fails its accuracy gate"):
        fp8_gate(bf16, static, GateThresholds(max_diff=gate["max_abs_diff"] / 2))

    bf16, static = engine_for(ckpt, **BEAM, precision="bf16"), engine_for(ckpt, **BEAM, precision="fp8-static")
    gate = fp8_gate(bf16, static, GateThresholds(min_shared=0.0))
    assert gate["prompts"] >= 3 and 0 <= gate["worst_prompt"] <= gate["shared_candidates"] <= 1
    with pytest.raises(SpecError, match="fails its accuracy gate"):
        fp8_gate(bf16, static, GateThresholds(min_shared=1.01))


def test_fp8_static_embeddings_are_near_bf16_and_gated_by_cosine_distance(random_checkpoint):
    """head: embedding in fp8-static: the same linears in E4M3; its gate measures each text's
    cosine distance to the bf16 embedding and refuses a build past the threshold."""
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    task = dict(task="score", head="embedding", max_texts=4, max_text_tokens=32)
    bf16, static = engine_for(ckpt, **task, precision="bf16"), engine_for(ckpt, **task, precision="fp8-static")
    assert isinstance(static.graph.model.layers[0].attn.qkv, StaticFp8Linear)
    gate = fp8_gate(bf16, static, GateThresholds(max_diff=0.05))
    assert gate["against"] == "bf16" and gate["texts"] >= 10
    assert 0 < gate["mean_cosine_distance"] <= gate["max_cosine_distance"] < 0.05
    with pytest.raises(SpecError, match="fails its accuracy gate"):
        fp8_gate(bf16, static, GateThresholds(max_diff=gate["max_cosine_distance"] / 2))


@pytest.mark.slow
def test_fp8_score_build_compiles_matches_eager_and_records_its_gate(random_checkpoint, tmp_path):
    """An fp8-static score package (AOTInductor, CPU): compiled equals eager, the manifest records
    the precision and the gate, and the served engine loads it with the scales its build
    calibrated, as the eager graph calibrates them. Its accuracy reference is the task compiled
    in bf16: it answers as the bf16 eager graph, and the online guard compares the served answers
    with it."""
    from slm_core.compile.package import build_package
    from slm_core.manifest import MANIFEST
    from slm_core.serve.accuracy_guard import AccuracyGuard
    from slm_core.serve.loader import load_package, reference_engine
    from slm_core.spec import RuntimeSpec
    from slm_core.tasks import LabelsTask

    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    task = TaskSpec.from_dict({**SCORE, "precision": "fp8-static"})
    manifest = build_package(
        ckpt, task, RuntimeSpec("cpu"), tmp_path / "pkg", gate=GateThresholds(max_diff=0.1), reference=True
    )
    assert manifest["reference"]["precision"] == "bf16" and manifest["reference"]["check"]["max_abs_diff"] <= 5e-2
    served = load_package(tmp_path / "pkg", engine=Engine)
    reference = reference_engine(tmp_path / "pkg", served.task, "cpu")
    bf16 = engine_for(ckpt, **SCORE, precision="bf16")
    for row, ref in zip(
        reference.run_one(["search engines rank documents"]), bf16.score(["search engines rank documents"])
    ):
        assert row == pytest.approx(ref, abs=LabelsTask.tolerance["bf16"])
    guard = AccuracyGuard(reference, share=1.0, max_diff=0.1, min_shared=0.6)
    guard.start()
    for k, texts in enumerate((["search engines rank documents", "a"], ["the lazy dog"])):
        assert guard.offer(f"r{k}", texts, served.run_one(texts), served.task)
    guard.wait()
    (one, two) = sorted(guard.drain(), key=lambda c: c.request_id)
    assert one.request_id == "r0" and 0 < one.max_abs_diff < 0.1 and not one.breach and one.shared == 1.0
    assert manifest == json.loads((tmp_path / "pkg" / MANIFEST).read_text())
    assert manifest["task"]["precision"] == "fp8-static" and manifest["dtype"] == "bfloat16"
    assert manifest["fp8_gate"]["max_abs_diff"] < 0.1 and manifest["check"]["max_abs_diff"] <= 5e-2
    eager = engine_for(ckpt, **SCORE, precision="fp8-static")
    texts = ["search engines rank documents", "a"]
    for row, ref in zip(load_package(tmp_path / "pkg", engine=Engine).score(texts), eager.score(texts)):
        # Inductor rounds a few values to the next E4M3 step
        assert row == pytest.approx(ref, abs=LabelsTask.tolerance["fp8-static"])
