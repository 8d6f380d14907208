"""CUDA (bf16) eager engine: against transformers bf16 on the same GPU and our own fp32 on CPU,
and torch.export on CUDA. Skipped without a GPU."""

import copy

import pytest
import torch
from helpers import engine_for, hf_score, text_ids

from slm_core import Engine
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.compile.checks import GateThresholds, fp8_gate
from slm_core.compile.export import compile_package, export_graph
from slm_core.serve.loader import CompiledGraph, load_graph
from slm_core.spec import RuntimeSpec

RANDOM_TEXTS = [
    "search",
    "a small language model scores texts",
    "is this query about shopping?",
    "the lazy dog " * 12,
    "12, 345 and 6789",
]

pytestmark = pytest.mark.gpu


@torch.no_grad()
def sequence_logprob(model, prompt_ids: list[int], ids: list[int]) -> float:
    """Teacher-forced cumulative log-probability of `ids` after the prompt (fp32 reference)."""
    logits = model(torch.tensor([prompt_ids + ids], device=model.device)).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids, device=model.device)[:, None]).sum().item()


def started_torchserve(tmp_path, store):
    """A private TorchServe on `store` (skips where TorchServe or Java is missing)."""
    import shutil

    from handlers.local_server import TorchServe

    if shutil.which("torchserve") is None or shutil.which("java") is None:
        pytest.skip("TorchServe/Java not installed here (source .devbundle/setup.sh on the GPU machine)")
    (tmp_path / "server").mkdir()
    return TorchServe(tmp_path / "server", store).start()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_cuda_bf16_score_and_beam(random_checkpoint, arch):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    task = dict(task="score", labels=["yes", "no", "maybe"], max_texts=8, max_text_tokens=64)
    gpu = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **task, precision="bf16")
    ours = gpu.score(RANDOM_TEXTS)
    hf_bf16 = copy.deepcopy(hf).to("cuda", torch.bfloat16)  # the fixture stays the fp32 CPU reference
    ref = hf_score(hf_bf16, text_ids(gpu, RANDOM_TEXTS), gpu.task.label_ids)
    fp32 = engine_for(ckpt, "cpu", **task).score(RANDOM_TEXTS)
    diff_hf = max(abs(a - b) for r, s in zip(ours, ref) for a, b in zip(r, s))
    diff_fp32 = max(abs(a - b) for r, s in zip(ours, fp32) for a, b in zip(r, s))
    print(f"\n[{arch}] score: cuda bf16 vs transformers cuda bf16 {diff_hf:.4f}, vs our cpu fp32 {diff_fp32:.4f}")
    assert diff_hf <= 0.03 and diff_fp32 <= 0.03

    beam = dict(task="beam", beam_width=16, new_tokens=5)
    prompt = "a small language model"
    gpu_beams = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **beam, precision="bf16").beam(prompt)
    cpu_beams = engine_for(ckpt, "cpu", **beam).beam(prompt)
    prompt_ids = text_ids(gpu, [prompt])[0]
    # Each bf16 candidate's score is its fp32 log-probability up to bf16 noise, no further from it
    # than transformers' own bf16 forward is: the search and its scores are right.
    fp32_logprob = [sequence_logprob(hf, prompt_ids, c["token_ids"]) for c in gpu_beams]
    ours_err = max(abs(c["score"] - lp) for c, lp in zip(gpu_beams, fp32_logprob))
    hf_err = max(
        abs(sequence_logprob(hf_bf16, prompt_ids, c["token_ids"]) - lp) for c, lp in zip(gpu_beams, fp32_logprob)
    )
    shared = {tuple(c["token_ids"]) for c in gpu_beams} & {tuple(c["token_ids"]) for c in cpu_beams}
    print(
        f"[{arch}] beam W=16: {len(shared)}/16 candidates shared with cpu fp32; max |score - fp32 log-prob|: "
        f"ours bf16 {ours_err:.4f}, transformers bf16 {hf_err:.4f}"
    )
    assert ours_err <= 2 * hf_err + 0.02
    assert len(shared) >= 10


def test_cuda_export(random_checkpoint):
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    for task in (
        dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32),
        dict(task="beam", beam_width=8, new_tokens=3, max_prompt_tokens=32),
    ):
        eng = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **task, precision="bf16")
        program = export_graph(eng.graph, eng.task).module()
        ids = torch.randint(0, ckpt.spec.vocab_size, (9,), dtype=torch.int32, device="cuda")
        cu = [0, 2, 9] if task["task"] == "score" else [0, 9]
        options = [eng.task.options(eng.task.request_of(["x"]))] if eng.task.option_columns else []
        args = (
            ids,
            torch.tensor(cu, dtype=torch.int32, device="cuda"),
            *[torch.tensor(options, dtype=torch.int32, device="cuda")] * bool(options),
        )
        for a, b in zip(
            torch.utils._pytree.tree_leaves(program(*args)), torch.utils._pytree.tree_leaves(eng.graph(*args))
        ):
            assert torch.equal(a, b)


def test_cuda_archive_serves_through_torchserve(random_checkpoint, tmp_path):
    """--device cuda build: manifest, load on cuda:0, equal to the eager CUDA engine; then the same
    archive through a real TorchServe (GPU workers; the default: 2 sync workers) answers exactly as
    the loaded package does."""
    import json
    import zipfile

    import yaml

    from archiver.__main__ import main
    from slm_core.manifest import MANIFEST
    from slm_core.serve.loader import load_package

    folder, _ = random_checkpoint("qwen3")
    task = dict(task="score", labels=["yes", "no"], max_texts=8, max_text_tokens=64, precision="bf16")
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    store = tmp_path / "store"
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(folder),
                "--task",
                str(tmp_path / "task.yaml"),
                "--model-name",
                "gpu_score",
                "--export-path",
                str(store),
                "--device",
                "cuda",
            ]
        )
        == 0
    )
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(store / "gpu_score.mar").extractall(unpacked)
    manifest = json.loads((unpacked / MANIFEST).read_text())
    config = yaml.safe_load((unpacked / "model-config.yaml").read_text())
    assert config["minWorkers"] == config["maxWorkers"] == 2 and config["batchSize"] == 2  # max_batch 4 (CUDA default)
    assert manifest["device"] == "cuda" and manifest["versions"]["capability"] == list(
        torch.cuda.get_device_capability()
    )
    assert manifest["kernels"] == "triton" and manifest["task"]["max_batch"] == 4  # the CUDA defaults
    compiled = load_package(unpacked, gpu_id=0, engine=Engine)
    assert compiled.device == torch.device("cuda", 0)
    assert len(compiled.context.replay.graphs) == 1  # the smallest bucket, called at load
    eager = engine_for(load_checkpoint(folder), "cuda", **task)
    for row, ref in zip(compiled.score(RANDOM_TEXTS), eager.score(RANDOM_TEXTS)):
        assert row == pytest.approx(ref, abs=2e-2)

    server = started_torchserve(tmp_path, store)
    try:
        server.register("gpu_score.mar")
        status, body = server.predict("gpu_score", json.dumps({"texts": RANDOM_TEXTS}).encode())
        assert status == 200
        for row, ref in zip(json.loads(body)["scores"], compiled.score(RANDOM_TEXTS)):
            assert row == pytest.approx(ref, abs=1e-6)
        workers = server.workers("gpu_score")
        assert len(workers) == 2 and all(w["gpu"] is True for w in workers), workers
    finally:
        server.stop()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_triton_attention_graphs_on_cuda(random_checkpoint, tmp_path, arch):
    """The Triton kernels on CUDA (the device's default): eager graphs agree with the reference
    graphs (bf16), and the score graph with the Triton ops exports and compiles with AOTInductor,
    equal to its eager run. Qwen3 takes the QK-norm branch of the fused QK-norm + RoPE kernel."""
    ckpt = load_checkpoint(random_checkpoint(arch)[0])
    score = dict(task="score", labels=["yes", "no"], max_texts=8, max_text_tokens=64, precision="bf16")
    ref, tri = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **score), engine_for(ckpt, "cuda", **score)
    for a, b in zip(ref.score(RANDOM_TEXTS), tri.score(RANDOM_TEXTS)):
        assert a == pytest.approx(b, abs=2e-2)
    beam = dict(task="beam", beam_width=16, new_tokens=5, precision="bf16")
    x = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **beam).beam("a small language model")
    y = engine_for(ckpt, "cuda", **beam).beam("a small language model")
    assert len({tuple(c["token_ids"]) for c in x} & {tuple(c["token_ids"]) for c in y}) >= 12

    program = export_graph(tri.graph, tri.task)
    package = compile_package(program, str(tmp_path / "g.pt2"))
    compiled = torch._inductor.aoti_load_package(package)
    ids = torch.randint(0, ckpt.spec.vocab_size, (40,), dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(compiled(ids, cu), tri.graph(ids, cu), atol=2e-2, rtol=0)
    # the worker's loader: its own CUDA runner on this torch (not the package loader's fallback),
    # single-threaded as CUDA-graph capture needs, equal to AOTInductor's loader
    worker = load_graph(package, "cuda:0", run_single_threaded=True)
    assert isinstance(worker, CompiledGraph)
    torch.testing.assert_close(worker(ids, cu), compiled(ids, cu), atol=0, rtol=0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    "lengths, heads",
    [
        ([1], (16, 8, 128)),  # one sequence of one token
        ([512], (14, 2, 64)),  # the max bound, one sequence
        ([160] * 15, (16, 8, 128)),  # W1 at its upper bound
        ([2] * 64, (14, 2, 64)),  # 64 sequences
        (list(range(16, 513, 33)), (9, 3, 64)),  # lengths 16..511, SmolLM2 heads
    ],
)
def test_packed_attention_bf16_full_size(lengths, heads):
    from slm_kernels.attention_ref import packed_attention_ref
    from slm_kernels.packed_attention import packed_attention

    hq, hkv, d = heads
    torch.manual_seed(len(lengths))
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, device="cuda") for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    out = packed_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, d**-0.5, max(lengths))
    err = rel_err(out, packed_attention_ref(q, k, v, cu, d**-0.5))
    print(f"\npacked {len(lengths)} seqs, {t} tokens, heads {heads}: rel err {err:.1e}")
    assert err <= 1e-2


@pytest.mark.parametrize(
    "w, lp, heads", [(1, 1, (16, 8, 128)), (100, 448, (14, 2, 64)), (400, 512, (9, 3, 64)), (400, 100, (16, 8, 128))]
)
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5])
def test_prefix_suffix_attention_bf16_full_size(w, lp, heads, s):
    from slm_kernels.attention_ref import prefix_suffix_attention_ref
    from slm_kernels.prefix_attention import prefix_suffix_attention

    hq, hkv, d = heads
    torch.manual_seed(w + lp + s)
    q = torch.randn(w, hq, d, device="cuda")
    kp, vp = torch.randn(lp, hkv, d, device="cuda"), torch.randn(lp, hkv, d, device="cuda")
    ks, vs = torch.randn(w, s, hkv, d, device="cuda"), torch.randn(w, s, hkv, d, device="cuda")
    bf = [x.bfloat16() for x in (q, kp, vp, ks, vs)]
    cu = torch.tensor([0, lp], dtype=torch.int32, device="cuda")
    err = rel_err(
        prefix_suffix_attention(*bf, d**-0.5, cu), prefix_suffix_attention_ref(q, kp, vp, ks, vs, d**-0.5, cu)
    )
    print(f"\nprefix W={w} Lp={lp} Ls={s} heads {heads}: rel err {err:.1e}")
    assert err <= 1e-2


def test_prefix_suffix_attention_bf16_several_prompts():
    """W3-like: 4 prompts of different lengths, 100 beams each, in one call."""
    from slm_kernels.attention_ref import prefix_suffix_attention_ref, random_prefix_inputs
    from slm_kernels.prefix_attention import prefix_suffix_attention

    torch.manual_seed(0)
    prompts, w, (hq, hkv, d) = [384, 512, 401, 450], 100, (14, 2, 64)
    q, kp, vp, ks, vs, cu = random_prefix_inputs(w, prompts, 3, (hq, hkv, d), "cuda")
    bf = [x.bfloat16() for x in (q, kp, vp, ks, vs)]
    got = prefix_suffix_attention(*bf, d**-0.5, cu)
    err = rel_err(got, prefix_suffix_attention_ref(q, kp, vp, ks, vs, d**-0.5, cu))
    print(f"\nprefix 4 prompts x W={w}: rel err {err:.1e}")
    assert err <= 1e-2


@pytest.mark.parametrize(
    "t, heads, norm",
    [(1640, (16, 8, 128), True), (800, (14, 2, 64), False), (400, (9, 3, 64), False), (1, (16, 8, 128), True)],
)
def test_qkv_rope_bf16_full_size(t, heads, norm):
    """W1 prefill (Qwen3, QK-norm), W2 decode rows (Qwen2.5), SmolLM2 heads, one token: bf16 kernel
    against the fp32 reference, and within bf16 rounding of the bf16 reference (transformers')."""
    from slm_kernels.layer_ref import qkv_rope_ref
    from slm_kernels.qkv_rope import qkv_rope

    hq, hkv, d = heads
    torch.manual_seed(t)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda") * 2
    angles = torch.rand(t, d // 2, device="cuda") * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    weights = (torch.rand(d, device="cuda") + 0.5, torch.rand(d, device="cuda") + 0.5) if norm else (None, None)
    bf = lambda x: None if x is None else x.bfloat16()  # noqa: E731
    got = qkv_rope(bf(qkv), bf(cos), bf(sin), hq, hkv, *map(bf, weights), 1e-6)
    fp32 = qkv_rope_ref(qkv, bf(cos).float(), bf(sin).float(), hq, hkv, *weights, 1e-6)
    bf16 = qkv_rope_ref(bf(qkv), bf(cos), bf(sin), hq, hkv, *map(bf, weights), 1e-6)
    for g, f, b in zip(got, fp32, bf16):
        assert g.dtype == torch.bfloat16 and g.is_contiguous()
        assert rel_err(g, f) <= 1e-2
        assert (g.float() - b.float()).abs().max().item() <= 0.05 * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("t, inner", [(1640, 3072), (800, 4864), (1, 1536)])
def test_silu_mul_bf16_full_size(t, inner):
    """W1 prefill (Qwen3-0.6B MLP), W2 decode rows (Qwen2.5-0.5B), one row (SmolLM2): equal to the
    bf16 reference (transformers' rounding points) up to one rounding, and close to fp32."""
    from slm_kernels.layer_ref import silu_mul_ref
    from slm_kernels.silu_mul import silu_mul

    torch.manual_seed(t)
    x = torch.randn(t, 2 * inner, device="cuda") * 4
    got = silu_mul(x.bfloat16())
    want = silu_mul_ref(x.bfloat16()).float()
    assert got.dtype == torch.bfloat16 and got.shape == (t, inner)
    assert ((got.float() - want).abs() <= 2**-6 * want.abs() + 1e-6).all()  # a rounding or two
    assert rel_err(got, silu_mul_ref(x.bfloat16().float())) <= 1e-2


@pytest.mark.parametrize("t, inner", [(1641, 3072), (801, 4864)])
def test_silu_mul_static_bf16_full_size(t, inner):
    """fp8-static's SiLU·up quantised with a fixed scale: values within one E4M3 step of the reference."""
    from slm_kernels.layer_ref import silu_mul_static_ref
    from slm_kernels.silu_mul import silu_mul_static

    torch.manual_seed(t)
    x = (torch.randn(t, 2 * inner, device="cuda") * 4).bfloat16()
    scale = 40.0 / 448
    q, rq = silu_mul_static(x, scale), silu_mul_static_ref(x, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (t, inner)
    got, want = q.float() * scale, rq.float() * scale
    assert ((got - want).abs() <= want.abs() / 8 + scale * 2**-9).all()


def test_fp8_static_graphs_bf16_on_cuda(random_checkpoint):
    """fp8-static (per-tensor E4M3 qkv and MLP, input scales calibrated at build) with the Triton
    kernels: StaticFp8Linear at the W1 gate/up shape is the product of its operands on cuBLAS; the
    score and beam graphs pass the accuracy gate against bf16 and export."""
    from slm_core.compile.fp8 import StaticFp8Linear
    from slm_kernels.layer_ref import quantize_static_ref

    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 6144, device="cuda").bfloat16()
    fp8, x = StaticFp8Linear(linear, 4.0), torch.randn(1700, 1024, device="cuda").bfloat16()
    qx = quantize_static_ref(x, fp8.input_scale)
    want = (qx.float() * fp8.input_scale) @ (fp8.weight.float() * fp8.weight_scale).t() + linear.bias.float()
    assert rel_err(fp8(x), want) <= 1e-2
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    for task in (
        dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32),
        dict(task="beam", beam_width=16, new_tokens=4, max_prompt_tokens=32),
    ):
        quant = engine_for(ckpt, "cuda", **task, precision="fp8-static")
        gate = fp8_gate(engine_for(ckpt, "cuda", **task, precision="bf16"), quant, GateThresholds(0.1, 0.5))
        print(f"\nfp8-static {task['task']}: {gate}")
        export_graph(quant.graph, quant.task)


@pytest.mark.parametrize("rows", [1, 100, 800])
def test_vocab_topk_bf16_full_size(rows):
    """The beam step's shape (V = 151,936, k = 2W = 200): the same values as torch.topk, ids that
    hold them, logsumexp as torch's, and the same answer twice."""
    from slm_kernels.vocab_topk import vocab_topk

    torch.manual_seed(rows)
    logits = (torch.randn(rows, 151936, device="cuda") * 3).bfloat16()
    values, ids, lse = vocab_topk(logits, 200)
    assert torch.equal(values.sort(-1, descending=True).values, logits.topk(200).values)
    assert torch.equal(logits.gather(1, ids), values)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct ids
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), atol=1e-3, rtol=0)
    again = vocab_topk(logits, 200)
    assert torch.equal(again[0], values) and torch.equal(again[1], ids)


@pytest.mark.parametrize(
    "rows, n, k",
    [
        (100, 4748, 200),  # W2's beams: their best groups of 32 logits ...
        (800, 6400, 200),  # ... and the best of those groups' logits, 8 prompts
        (1, 20000, 200),  # one W2 prompt's continuations (W x 2W)
        (8, 20000, 200),
        (1, 320000, 800),  # W = 400: three levels
        (8, 300, 100),  # the finished pool's merge (W of 3W)
    ],
)
def test_row_topk_full_size(rows, n, k):
    """The beam step's selections at full size: the same values as torch.topk, the columns that hold
    them in column order, the same answer twice; bf16 logits and fp32 scores."""
    from slm_kernels.row_topk import row_topk

    torch.manual_seed(n)
    for x in (torch.randn(rows, n, device="cuda") * 3 - 20, (torch.randn(rows, n, device="cuda") * 3).bfloat16()):
        values, ids = row_topk(x, k)
        assert torch.equal(values.sort(-1, descending=True).values, x.topk(k).values)
        assert torch.equal(x.gather(1, ids), values)
        assert (ids.diff(dim=-1) > 0).all()
        again = row_topk(x, k)
        assert torch.equal(again[0], values) and torch.equal(again[1], ids)


def test_vocab_topk_beam_graph_bf16_on_cuda(random_checkpoint):
    """The beam graph with the Triton top-k's (the CUDA default) answers as with torch.topk (bf16:
    near-ties may swap), and it exports."""
    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    beam = dict(task="beam", beam_width=16, new_tokens=5, precision="bf16")
    tri = engine_for(ckpt, "cuda", **beam)
    y = tri.beam("a small language model")
    assert tri.graph.topk is not None and tri.graph.row_topk is not None
    plain = engine_for(ckpt, "cuda", **beam)
    plain.graph.topk = plain.graph.row_topk = None  # torch.topk + torch.logsumexp, the Triton kernels otherwise
    x = plain.beam("a small language model")
    assert len({tuple(c["token_ids"]) for c in x} & {tuple(c["token_ids"]) for c in y}) >= 14
    assert x[0]["score"] == pytest.approx(y[0]["score"], abs=1e-3)
    export_graph(tri.graph, tri.task)


SECOND_GPU = """
import json, sys, torch
from slm_core.serve.loader import load_package
engine = load_package(sys.argv[1], gpu_id=1)
rows = engine.run_one(json.loads(sys.argv[2]))
print(json.dumps({"device": str(engine.device), "current": torch.cuda.current_device(), "rows": rows,
                  "reserved": [torch.cuda.memory_reserved(i) for i in range(2)],
                  "replayed": len(engine.context.replay.graphs)}))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the device tool's nvidia-h200-x2)")
def test_two_gpus_one_package_workers_on_each(random_checkpoint, tmp_path):
    """One CUDA archive with --device-ids 0,1 --workers 2: the package built on GPU 0
    loads on GPU 1 and answers as on GPU 0, with nothing of the engine's on GPU 0 (its own
    process); through TorchServe its two workers sit one per GPU and every answer is the same."""
    import concurrent.futures
    import json
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    import yaml

    from archiver.__main__ import main
    from bench.run import worker_gpus
    from slm_core.serve.loader import load_package

    folder, _ = random_checkpoint("qwen3")
    task = dict(task="score", labels=["yes", "no"], max_texts=8, max_text_tokens=64, precision="bf16")
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    store = tmp_path / "store"
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(folder),
                "--task",
                str(tmp_path / "task.yaml"),
                "--model-name",
                "two",
                "--export-path",
                str(store),
                "--device",
                "cuda",
                "--workers",
                "2",
                "--device-ids",
                "0,1",
            ]
        )
        == 0
    )
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(store / "two.mar").extractall(unpacked)
    assert yaml.safe_load((unpacked / "model-config.yaml").read_text())["deviceIds"] == [0, 1]
    on_first = load_package(unpacked, gpu_id=0, engine=Engine).score(RANDOM_TEXTS)

    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", SECOND_GPU, str(unpacked), json.dumps(RANDOM_TEXTS)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    second = json.loads(run.stdout.strip().splitlines()[-1])
    assert second["device"] == "cuda:1" and second["current"] == 1 and second["replayed"] >= 1  # captured at load
    assert second["reserved"][0] == 0 and second["reserved"][1] > 0, second["reserved"]
    for row, ref in zip(second["rows"], on_first):
        assert row == pytest.approx(ref, abs=1e-6)

    server = started_torchserve(tmp_path, store)
    try:
        server.register("two.mar", 2)
        assert sorted(worker_gpus(server, "two")) == [0, 1]
        body = json.dumps({"texts": RANDOM_TEXTS}).encode()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: server.predict("two", body), range(32)))
        assert all(status == 200 for status, _ in answers)
        for _, got in answers:
            for row, ref in zip(json.loads(got)["scores"], on_first):
                assert row == pytest.approx(ref, abs=1e-6)
        log = (tmp_path / "server" / "logs" / "model_log.log").read_text()
        assert "task on cuda:0" in log and "task on cuda:1" in log  # the handler's load line
    finally:
        server.stop()


def test_cuda_catalog_beam_triton_and_export(random_checkpoint, tmp_path):
    """The catalog-constrained beam graph on CUDA: Triton kernels against the references (bf16:
    near-ties may swap), both only ever naming catalog items, and its AOTInductor compile with the
    catalog as inputs equal to the eager graph; a second catalog runs in the same compiled graph."""
    import random

    from helpers import write_catalog

    from slm_core.compile.checks import check_compiled

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    rng = random.Random(0)
    items = sorted({(rng.randrange(10, 60), rng.randrange(60, 110), rng.randrange(110, 160)) for _ in range(400)})
    write_catalog(tmp_path / "c.jsonl", [list(i) for i in items])
    for scores in ("vocab", "catalog"):
        task = dict(
            task="beam",
            beam_width=16,
            new_tokens=3,
            precision="bf16",
            catalog=str(tmp_path / "c.jsonl"),
            catalog_scores=scores,
        )
        ref = engine_for(ckpt, RuntimeSpec("cuda", "reference"), **task).run_one("a small language model")
        tri = engine_for(ckpt, "cuda", **task)
        got = tri.run_one("a small language model")
        assert all(tuple(c["token_ids"]) in set(items) for c in ref["candidates"] + got["candidates"])
        shared = {c["id"] for c in ref["candidates"]} & {c["id"] for c in got["candidates"]}
        print(f"catalog beam ({scores}) W=16: {len(shared)}/16 shared between Triton and the references")
        assert len(shared) >= 12
    package = compile_package(export_graph(tri.graph, tri.task), str(tmp_path / "g.pt2"))
    compiled = torch._inductor.aoti_load_package(package)
    items2 = sorted({(rng.randrange(10, 60), rng.randrange(60, 110), rng.randrange(110, 160)) for _ in range(900)})
    write_catalog(tmp_path / "c2.jsonl", [list(i) for i in items2])
    other = engine_for(ckpt, "cuda", **{**task, "catalog": str(tmp_path / "c2.jsonl")})
    for eager in (tri, other):  # the compiled graph with each catalog, judged as the build judges it
        check = check_compiled(eager, Engine(compiled, eager.task, "cuda"))
        print(f"compiled catalog graph against eager, {eager.task.catalog.size} items: {check}")
    # a worker following a catalog store: CUDA graphs replayed, the catalog swapped in place (a
    # catalog within its buffers' headroom) or into new buffers with the graphs captured again
    from slm_core.serve.catalog_watch import HEADROOM
    from slm_core.serve.loader import serving_engine

    served = serving_engine(package, tri.task, torch.device("cuda"), True, Engine, headroom=HEADROOM)
    check_compiled(tri, served)  # captures the buckets the check's calls land in
    graphs = len(served.context.replay.graphs)
    assert graphs > 0
    items3 = items[:380] + sorted(set(items2) - set(items))[::25][:20]  # 20 new ones, spread over the trie
    write_catalog(tmp_path / "c3.jsonl", [list(i) for i in items3])
    near = engine_for(ckpt, "cuda", **{**task, "catalog": str(tmp_path / "c3.jsonl")})
    for eager, version, in_place in ((near, "near", True), (other, "other", False), (tri, "first", True)):
        eager.task.catalog.save(tmp_path / f"{version}.safetensors")
        assert served.swap(served.task.with_data(tmp_path / f"{version}.safetensors", version)) is in_place
        assert len(served.context.replay.graphs) == (graphs if in_place else 0)  # new buffers: captured anew
        check = check_compiled(eager, served)
        answer = served.run_one(served.task.request({"prompt": "a small language model"}))
        assert answer["catalog_version"] == version
        assert {c["id"] for c in answer["candidates"]} <= {
            eager.task.catalog.item_id(i) for i in range(eager.task.catalog.size)
        }
        print(f"CUDA graphs, catalog {version} swapped {'in place' if in_place else 'into new buffers'}: {check}")
