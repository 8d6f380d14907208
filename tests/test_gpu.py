"""CUDA (bf16) eager engine: against transformers bf16 on the same GPU and our own fp32 on CPU,
and torch.export on CUDA. Skipped without a GPU."""

import pytest
import torch

from hf_ref import hf_score
from slm_core.checkpoint import load_checkpoint
from slm_core.export import export_graph
from test_hf_equality import RANDOM_TEXTS, engine_for, text_ids

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_cuda_bf16_score_and_beam(random_checkpoint, arch):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    task = dict(task="score", labels=["yes", "no", "maybe"], max_texts=8, max_text_tokens=64)
    gpu = engine_for(ckpt, "cuda", **task, precision="bf16")
    cpu = engine_for(ckpt, "cpu", **task)
    ours = gpu.score(RANDOM_TEXTS)
    hf_gpu = hf.to("cuda", torch.bfloat16)
    try:
        ref = hf_score(hf_gpu, text_ids(gpu, RANDOM_TEXTS), gpu.graph.label_ids)
    finally:
        hf.to("cpu", torch.float32)  # the session fixture stays the fp32 CPU reference
    fp32 = cpu.score(RANDOM_TEXTS)
    for row, ref_row, row32 in zip(ours, ref, fp32):
        assert row == pytest.approx(ref_row, abs=0.03)
        assert row == pytest.approx(row32, abs=0.03)

    beam = dict(task="beam", beam_width=16, new_tokens=5)
    gpu_beams = engine_for(ckpt, "cuda", **beam, precision="bf16").beam("a small language model")
    cpu_beams = engine_for(ckpt, "cpu", **beam).beam("a small language model")
    assert gpu_beams[0]["token_ids"] == cpu_beams[0]["token_ids"]
    shared = {tuple(c["token_ids"]) for c in gpu_beams} & {tuple(c["token_ids"]) for c in cpu_beams}
    assert len(shared) >= 12


def test_cuda_export(random_checkpoint):
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    for task in (dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32),
                 dict(task="beam", beam_width=8, new_tokens=3, max_prompt_tokens=32)):
        eng = engine_for(ckpt, "cuda", **task, precision="bf16")
        program = export_graph(eng.graph, eng.task).module()
        ids = torch.randint(0, ckpt.spec.vocab_size, (9,), dtype=torch.int32, device="cuda")
        args = (ids, torch.tensor([0, 2, 9], dtype=torch.int32, device="cuda")) if task["task"] == "score" else (ids,)
        for a, b in zip(torch.utils._pytree.tree_leaves(program(*args)), torch.utils._pytree.tree_leaves(eng.graph(*args))):
            assert torch.equal(a, b)
