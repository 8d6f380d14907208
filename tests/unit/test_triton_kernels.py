"""Triton kernels against their PyTorch references in Triton's CPU interpreter (fp32: bf16 tl.dot
is wrong there). The interpreter must be chosen before triton is imported, so each check runs in
a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

PACKED_CHECK = r"""
import json, sys, torch
from slm_kernels.packed_attention import packed_attention
from slm_kernels.attention_ref import packed_attention_ref
errors = []
for lengths, (hq, hkv, d), block in json.loads(sys.argv[1]):
    torch.manual_seed(len(lengths))
    t = sum(lengths)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    ref = packed_attention_ref(q, k, v, cu, d ** -0.5)
    for block_m, block_n in ((block, block), (block, 2 * block), (2 * block, block), (0, 0)):  # 0: the graphs' defaults
        out = packed_attention(q, k, v, cu, d ** -0.5, max_seqlen=max(lengths), block_m=block_m, block_n=block_n)
        errors.append((out - ref).abs().max().item())
print(json.dumps(errors))
"""

PACKED_CASES = [
    ([1], (4, 4, 16), 16),  # one sequence of one token
    ([5, 1, 12, 3], (6, 2, 64), 16),  # GQA, lengths not multiples of the block
    ([70, 3, 130], (8, 1, 32), 32),  # MQA, several blocks per sequence, causal limit inside a block
    ([2] * 64, (4, 2, 16), 16),  # 64 sequences
    ([48], (2, 1, 128), 16),  # head_dim 128, the task bound as the only sequence
]


def run_check(script: str, cases: list):
    """Run `script` over `cases` in a fresh interpreter-mode process; its max errors per case."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_packed_attention_matches_reference_in_interpreter():
    errors = run_check(PACKED_CHECK, PACKED_CASES)
    assert len(errors) == 4 * len(PACKED_CASES) and max(errors) < 1e-5, errors


PREFIX_CHECK = r"""
import json, sys, torch
from slm_kernels.prefix_attention import prefix_suffix_attention
from slm_kernels.attention_ref import prefix_suffix_attention_ref, random_prefix_inputs
errors = []
for w, prompts, s, (hq, hkv, d), block_w in json.loads(sys.argv[1]):
    torch.manual_seed(w + sum(prompts))
    q, kp, vp, ks, vs, cu = random_prefix_inputs(w, prompts, s, (hq, hkv, d))
    out = prefix_suffix_attention(q, kp, vp, ks, vs, d ** -0.5, cu, block_w=block_w, block_n=16)
    errors.append((out - prefix_suffix_attention_ref(q, kp, vp, ks, vs, d ** -0.5, cu)).abs().max().item())
print(json.dumps(errors))
"""

PREFIX_CASES = [
    (1, [1], 1, (4, 4, 16), 4),  # W = 1, a one-token prompt, L_s = 1
    (5, [7], 2, (14, 2, 64), 4),  # Qwen2.5-0.5B heads: a group of 7 (padded to 8)
    (3, [11], 4, (9, 3, 64), 2),  # SmolLM2 heads: a group of 3
    (33, [40], 5, (8, 1, 32), 8),  # L_s = 5, beams not a multiple of the block
    (400, [20], 3, (2, 2, 128), 16),  # W = 400, head_dim 128
    (6, [5, 1, 19], 2, (6, 2, 16), 4),  # three prompts of different lengths in one call
    (1, [5, 1, 19], 0, (16, 8, 128), 32),  # no suffix, one row per sequence: the last prefill layer (Qwen3 heads)
    (1, [7, 30], 0, (14, 2, 64), 8),  # ... Qwen2.5 heads
    (5, [70], 2, (14, 2, 64), 4),  # 70 keys: blocks of 16, the last one partial
    (4, [0, 5], 2, (4, 2, 16), 4),  # an empty prompt: the suffix alone
]


def test_prefix_suffix_attention_matches_reference_in_interpreter():
    errors = run_check(PREFIX_CHECK, PREFIX_CASES)
    assert len(errors) == len(PREFIX_CASES) and max(errors) < 1e-5, errors


QKV_ROPE_CHECK = r"""
import json, sys, torch
from slm_kernels.qkv_rope import qkv_rope
from slm_kernels.layer_ref import qkv_rope_ref
errors = []
for t, hq, hkv, d, norm in json.loads(sys.argv[1]):
    torch.manual_seed(t + hq)
    qkv = torch.randn(t, (hq + 2 * hkv) * d) * 3
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    weights = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if norm else (None, None)
    got = qkv_rope(qkv, cos, sin, hq, hkv, *weights, 1e-6)
    want = qkv_rope_ref(qkv, cos, sin, hq, hkv, *weights, 1e-6)
    assert all(g.is_contiguous() and g.shape == w.shape for g, w in zip(got, want))
    errors.append(max((g - w).abs().max().item() for g, w in zip(got, want)))
print(json.dumps(errors))
"""

QKV_ROPE_CASES = [
    (1, 1, 1, 16, False),  # one token, one head
    (5, 16, 8, 128, True),  # Qwen3-0.6B heads, QK-norm
    (7, 14, 2, 64, False),  # Qwen2.5-0.5B: 14 q heads (padded to 16), no QK-norm
    (4, 9, 3, 64, True),  # SmolLM2 heads: v of 3 * 64 (padded to 256)
]


def test_qkv_rope_matches_reference_in_interpreter():
    errors = run_check(QKV_ROPE_CHECK, QKV_ROPE_CASES)
    assert len(errors) == len(QKV_ROPE_CASES) and max(errors) < 1e-5, errors


SILU_CHECK = r"""
import json, sys, torch
from slm_kernels.silu_mul import silu_mul
from slm_kernels.layer_ref import silu_mul_ref
errors = []
for t, inner, block in json.loads(sys.argv[1]):
    torch.manual_seed(t + inner)
    x = torch.randn(t, 2 * inner) * 4
    got = silu_mul(x, block)
    assert got.shape == (t, inner) and got.is_contiguous()
    errors.append((got - silu_mul_ref(x)).abs().max().item())
print(json.dumps(errors))
"""


SILU_STATIC_CHECK = r"""
import json, sys, torch
from slm_kernels.silu_mul import silu_mul_static
from slm_kernels.layer_ref import silu_mul_static_ref
out = []
for t, inner, block, amax in json.loads(sys.argv[1]):
    torch.manual_seed(t + inner)
    x = torch.randn(t, 2 * inner) * 4
    scale = amax / 448.0
    q, rq = silu_mul_static(x, scale, block), silu_mul_static_ref(x, scale)
    got, want = q.float() * scale, rq.float() * scale
    # Within one E4M3 step of the reference: the interpreter's fp32 -> E4M3 cast (Triton 3.x, numpy
    # emulation) may round to the neighbouring value, and casts an exact power of two to half of it
    # (2.0 -> 1.0); bf16 inputs are the GPU tests' (tests/gpu).
    step = want.abs() / 8 + scale * 2**-9
    power_of_two = (rq.float() != 0) & (rq.float().abs().log2() == rq.float().abs().log2().round())
    ok = ((got - want).abs() <= step) | (power_of_two & (q.float() == rq.float() / 2))
    out.append({"shape": list(q.shape) == [t, inner] and q.dtype == torch.float8_e4m3fn,
                "within_a_step": bool(ok.all()),
                "saturated": int((rq.float().abs() == 448).sum()), "max_ok": q.float().abs().max().item() <= 448})
print(json.dumps(out))
"""


def test_silu_mul_static_matches_reference_in_interpreter():
    """SiLU·up quantised to E4M3 with one scale fixed in advance: values within one E4M3 step of
    the reference; a scale too small for the values saturates them at E4M3's largest (case 2)."""
    cases = [(3, 8, 16, 30.0), (4, 100, 32, 2.0), (3, 300, 128, 60.0)]
    results = run_check(SILU_STATIC_CHECK, cases)
    assert all(r["shape"] and r["within_a_step"] and r["max_ok"] for r in results), results
    assert results[1]["saturated"] > 0 and results[0]["saturated"] == 0, results


def test_silu_mul_matches_reference_in_interpreter():
    cases = [(1, 8, 16), (5, 100, 32), (3, 300, 128)]  # widths not multiples of the block
    errors = run_check(SILU_CHECK, cases)
    assert len(errors) == len(cases) and max(errors) < 1e-5, errors


TOPK_CHECK = r"""
import json, sys, torch
from slm_kernels.vocab_topk import vocab_topk
out = []
for rows, vocab, k, kind in json.loads(sys.argv[1]):
    torch.manual_seed(vocab + k)
    x = torch.randn(rows, vocab) * 3 if kind != "ties" else torch.randint(-4, 4, (rows, vocab)).float() / 2
    if kind == "bf16":
        x = x.bfloat16()
    if kind == "masked":  # -inf logits, a whole block of them and a whole row
        x[:, 192:384] = float("-inf")
        x[-1] = float("-inf")
    values, ids, lse = vocab_topk(x, k, group=8, block=64)
    values, x = values.float(), x.float()
    want = torch.topk(x, k).values
    finite = ~x.isneginf().all(1)  # a row of -inf has no distinct ids to give
    out.append({
        "values_equal": torch.equal(values.sort(-1, descending=True).values, want),
        "ids_hold_values": torch.equal(x.gather(1, ids), values)
                           and all(len(set(r.tolist())) == k for r in ids[finite]),
        "lse_err": (lse - torch.logsumexp(x, -1)).nan_to_num(posinf=1.0).abs().max().item(),
    })
print(json.dumps(out))
"""


def test_vocab_topk_matches_torch_in_interpreter():
    """Exact top-k (values as torch.topk's, distinct ids that hold them) and logsumexp: fp32 and
    bf16 logits, rows of few distinct values (ties across groups), k = 1, k = V, a vocabulary that
    is no whole number of groups, groups lowered until a row has k of them, -inf logits."""
    cases = [
        (3, 1000, 7, "normal"),
        (2, 700, 200, "ties"),
        (4, 5000, 200, "normal"),
        (1, 64, 64, "normal"),
        (2, 300, 1, "ties"),
        (3, 3001, 200, "bf16"),
        (2, 700, 5, "masked"),
        (2, 997, 40, "ties"),
    ]
    for r in run_check(TOPK_CHECK, cases):
        assert r["values_equal"] and r["ids_hold_values"] and r["lse_err"] < 1e-5, r


ROW_TOPK_CHECK = r"""
import json, sys, torch
from slm_kernels.row_topk import row_topk
out = []
for rows, n, k, kind, block in json.loads(sys.argv[1]):
    torch.manual_seed(n + k)
    x = torch.randn(rows, n) * 3 - 20 if kind != "ties" else torch.randint(-4, 4, (rows, n)).float() / 2
    if kind == "bf16":
        x = x.bfloat16()
    if kind == "masked":  # beams past a prompt's width hold -inf, some rows have fewer than k finite
        x[:, ::3] = float("-inf")
        x[-1, 1:] = float("-inf")
    if kind == "special":  # NaN ranks above +inf (torch.topk's order), -0.0 beside +0.0
        x[:, 5], x[:, 9], x[:, 11], x[:, 12] = float("nan"), float("inf"), -0.0, 0.0
    values, ids = row_topk(x, k, block=block)
    want = torch.topk(x.float(), k).values
    key = lambda t: t.float().nan_to_num(nan=float("inf")).sort(-1, descending=True).values
    # among equal values at the k-th place, the lowest columns (torch.topk takes any of them)
    ties_lowest = True
    for r in range(rows):
        kth = want[r, -1]
        equal = (x[r].float() == kth).nonzero().flatten().tolist()
        taken = [i for i in ids[r].tolist() if x[r, i].float() == kth]
        ties_lowest &= bool(kth.isnan()) or taken == equal[: len(taken)]
    out.append({
        "values_equal": torch.equal(key(values), key(want)),
        "ids_hold_values": torch.equal(x.gather(1, ids).nan_to_num(nan=7.0), values.nan_to_num(nan=7.0)),
        "column_order": bool((ids.diff(dim=1) > 0).all()),
        "ties_lowest": ties_lowest,
    })
print(json.dumps(out))
"""


def test_row_topk_matches_torch_in_interpreter():
    """Exact top-k per row (values as torch.topk's, the columns that hold them, in column order, the
    lowest of equal values at the k-th place): one chunk, rows cut into chunks over two and three
    levels, k = 1 and k = N, few distinct values, bf16, -inf rows, NaN and signed zeros."""
    cases = [
        (3, 300, 100, "normal", 8192),  # the running beams' (W of 2W) and pool's shapes, one chunk
        (2, 5000, 64, "normal", 1024),  # five chunks, then one
        (1, 20000, 200, "normal", 512),  # 40 chunks, then 8, then 2, then 1 (W2's continuations, small blocks)
        (4, 37, 37, "normal", 8192),  # k = N, a row shorter than its block
        (2, 1000, 1, "ties", 256),
        (3, 700, 50, "ties", 128),  # ties across chunks and at the k-th place
        (2, 500, 200, "masked", 128),
        (4, 3000, 200, "bf16", 512),
        (2, 40, 10, "special", 16),
    ]
    for case, r in zip(cases, run_check(ROW_TOPK_CHECK, cases)):
        assert all(r.values()), (case, r)


def test_wrappers_refuse_bad_shapes():
    import torch

    from slm_kernels.packed_attention import packed_attention

    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported shapes"):
        packed_attention(torch.randn(4, 3, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), cu, 0.25, 4)
    with pytest.raises(ValueError, match="head dimension must be contiguous"):
        q = torch.randn(4, 16, 2).transpose(1, 2)
        packed_attention(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), cu, 0.25, 4)
    from slm_kernels.vocab_topk import vocab_topk

    for k in (0, 11):
        with pytest.raises(ValueError, match="unsupported k"):
            vocab_topk(torch.randn(2, 10), k)
    from slm_kernels.row_topk import row_topk

    for k in (0, 11):
        with pytest.raises(ValueError, match="unsupported k"):
            row_topk(torch.randn(2, 10), k)
    with pytest.raises(ValueError, match="not a power of two"):
        row_topk(torch.randn(2, 10), 3, block=100)
    from slm_kernels.prefix_attention import prefix_suffix_attention

    with pytest.raises(ValueError, match="unsupported shapes"):
        prefix_suffix_attention(
            torch.randn(4, 4, 16),
            torch.randn(3, 2, 16),
            torch.randn(3, 2, 16),
            torch.randn(5, 1, 2, 16),
            torch.randn(5, 1, 2, 16),
            0.25,
            torch.tensor([0, 3], dtype=torch.int32),
        )


ENGINE_CHECK = r"""
import json, sys, tempfile, pathlib, torch
sys.path.insert(0, "tests")
from conftest import RANDOM_CONFIGS, train_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.api import Engine
from slm_core.compile.eager import eager_engine
from slm_core.spec import RuntimeSpec, TaskSpec
out = {}
for arch in json.loads(sys.argv[1]):
    folder = pathlib.Path(tempfile.mkdtemp())
    train_tokenizer(folder / "tokenizer.json")
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = AutoConfig.for_model(arch, vocab_size=vocab, initializer_range=0.25, **RANDOM_CONFIGS[arch])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    ckpt = load_checkpoint(folder)
    def engine(task, kernels):
        spec = TaskSpec.from_dict({"precision": "fp32", **task})
        return eager_engine(ckpt, spec, RuntimeSpec("cpu", kernels), Engine)
    score = {"task": "score", "labels": ["yes", "no"], "max_texts": 4, "max_text_tokens": 48}
    texts = ["a", "search engines rank documents", "the lazy dog " * 4]
    a, b = engine(score, "reference").score(texts), engine(score, "triton").score(texts)
    beam = {"task": "beam", "beam_width": 4, "new_tokens": 3, "max_prompt_tokens": 32}
    x, y = engine(beam, "reference").beam("a small language"), engine(beam, "triton").beam("a small language")
    out[arch] = {"score": max(abs(p - q) for r, s in zip(a, b) for p, q in zip(r, s)),
                 "beam_tokens_equal": [c["token_ids"] for c in x] == [c["token_ids"] for c in y],
                 "beam_score": max(abs(c["score"] - d["score"]) for c, d in zip(x, y))}
print(json.dumps(out))
"""


def test_engine_with_triton_kernels_equals_reference_in_interpreter():
    """The graphs with the Triton kernels (RuntimeSpec kernels "triton": attention, QK-norm + RoPE,
    SiLU·up and the beam's vocabulary top-k) equal the reference graphs: GQA (qwen2, group 2), MQA
    with all biases (llama) and QK-norm (qwen3)."""
    result = run_check(ENGINE_CHECK, ["qwen2", "llama", "qwen3"])
    for arch, r in result.items():
        assert r["score"] < 1e-5 and r["beam_tokens_equal"] and r["beam_score"] < 1e-4, (arch, r)
