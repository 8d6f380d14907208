"""Triton kernels on the GPU at workload shapes: error against the fp32 reference, and time
against the alternatives available there. "gpu_ms" is the GPU time of one call replayed from a
CUDA graph, without launch overhead; "eager_call_ms" is one call from Python, launch included
(the compiled graphs launch from C++). The alternatives: for prefill the PyTorch reference, padded
flash SDPA with and without its pad/unpad, flash `varlen_attn` and compiled flex attention with a
precomputed document-causal block mask; for beam decode SDPA over the prompt K/V copied per beam;
for QK-norm + RoPE and SiLU * up what Inductor generates from the reference (what the graphs ran
before the kernels). Also the beam step's vocabulary top-k with its logsumexp: PyTorch's against
slm_kernels/vocab_topk.py, and the step's selections (each prompt's best continuations, its
running beams, its finished pool) through torch.topk and through slm_kernels/row_topk.py.

    python -m bench.kernels_bench --out FILE.json [--only "selection"]
"""

import argparse
import contextlib
import json
import random

import torch
import torch.nn.functional as F

from slm_kernels.attention_ref import packed_attention_ref, prefix_suffix_attention_ref, random_prefix_inputs
from slm_kernels.layer_ref import qkv_rope_ref, silu_mul_ref
from slm_kernels.packed_attention import packed_attention
from slm_kernels.prefix_attention import prefix_suffix_attention
from slm_kernels.qkv_rope import qkv_rope
from slm_kernels.row_topk import row_topk
from slm_kernels.silu_mul import silu_mul
from slm_kernels.vocab_topk import vocab_topk


def median_ms(fn, iters: int = 50) -> float:
    """Median CUDA-event time of one eager call. A kernel launched from Python pays its launch
    overhead here (tens of µs for a Triton kernel), which the compiled graphs do not."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, calls: int = 20, replays: int = 20) -> float:
    """GPU time of one call without launch overhead: median over replays of a CUDA graph holding
    `calls` back-to-back calls, divided by `calls`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, replays) / calls


@contextlib.contextmanager
def blas(library: str):
    """cuBLAS's GEMMs through the given library ("cublas" or "cublaslt") inside the block: the choice
    is read at each call, so a CUDA graph captured inside keeps the kernels it picked."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def timed(fn, ref) -> dict:
    result = {"eager_call_ms": median_ms(fn), "rel_err": rel_err(fn(), ref)}
    try:
        result["gpu_ms"] = graph_ms(fn)
    except Exception as e:  # an alternative that cannot be captured is reported, not fatal
        result.update(gpu_ms=float("nan"), graph_error=f"{type(e).__name__}: {e}"[:300])
    return result


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def prefill(lengths: list[int], hq: int, hkv: int, d: int) -> dict:
    t, dev = sum(lengths), "cuda"
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
    scale = d**-0.5
    ref = packed_attention_ref(q.float(), k.float(), v.float(), cu, scale)
    out = {"shape": f"{len(lengths)} seqs, {t} tokens, {hq}/{hkv} heads, d={d}", "results": {}}
    r = out["results"]
    group_pad = 1 << (hq // hkv - 1).bit_length()
    for rows, bn, warps, stages in (
        (64, 64, 4, 3),
        (64, 64, 4, 2),
        (64, 32, 4, 3),
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (256, 64, 8, 3),
    ):  # rows: positions x the padded group
        bm = max(1, rows // group_pad)
        if bm * group_pad >= 16:
            fn = lambda: packed_attention(q, k, v, cu, scale, max(lengths), bm, bn, warps, stages)  # noqa: E731
            r[f"triton packed {bm} positions x {group_pad} heads, {bn} keys w{warps} s{stages}"] = timed(fn, ref)
    r["reference (dense mask)"] = timed(lambda: packed_attention_ref(q, k, v, cu, scale), ref)

    # Padded flash: each token's row in the padded [N * Lmax] layout, computed once per request
    # (a graph would do it once for all layers), then per layer pad q/k/v, flash SDPA, unpad.
    lmax, n = max(lengths), len(lengths)
    pos = torch.cat([torch.arange(n_, device=dev) + i * lmax for i, n_ in enumerate(lengths)])
    pad = lambda x: x.new_zeros(n * lmax, x.shape[1], d).index_copy_(0, pos, x).view(n, lmax, -1, d).transpose(1, 2)  # noqa: E731

    def padded():
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(n * lmax, hq, d)[pos]

    r["padded flash SDPA incl. pad/unpad"] = timed(padded, ref)
    qp, kp, vp = pad(q), pad(k), pad(v)
    flash = lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)  # noqa: E731
    r["padded flash SDPA, kernel only (inputs pre-padded)"] = timed(
        lambda: flash().transpose(1, 2).reshape(n * lmax, hq, d)[pos], ref
    )
    r.update(varlen(q, k, v, cu, lmax, ref), **flex(q, k, v, lengths, ref))
    return out


def varlen(q, k, v, cu, lmax: int, ref) -> dict:
    """torch.nn.attention.varlen.varlen_attn (flash varlen), causal, GQA native where supported."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        fn = lambda: varlen_attn(q, k, v, cu, cu, lmax, lmax, enable_gqa=True, **causal)  # noqa: E731
        name = "varlen_attn (GQA)"
    else:
        g = q.shape[1] // k.shape[1]

        def fn():
            return varlen_attn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), cu, cu, lmax, lmax, **causal)

        name = "varlen_attn (K/V expanded per q head, incl. the expand)"
    return {name: timed(fn, ref)}


def flex(q, k, v, lengths: list[int], ref) -> dict:
    """Compiled flex attention with a document-causal block mask built once, outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), torch.tensor(lengths, device=q.device))
    mask = lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)  # noqa: E731
    t = q.shape[0]
    block = create_block_mask(mask, None, None, t, t, device=q.device)
    compiled = torch.compile(flex_attention)
    qf, kf, vf = (x.transpose(0, 1)[None] for x in (q, k, v))
    fn = lambda: compiled(qf, kf, vf, block_mask=block, enable_gqa=True)[0].transpose(0, 1)  # noqa: E731
    return {"flex attention (compiled, block mask precomputed)": timed(fn, ref)}


def decode(width: int, prompts: list[int], suffix: int, hq: int, hkv: int, d: int) -> dict:
    dev, scale = "cuda", d**-0.5
    rows, t = width * len(prompts), sum(prompts)
    q, kp, vp, ks, vs, cu = random_prefix_inputs(width, prompts, suffix, (hq, hkv, d), dev, torch.bfloat16)
    ref = prefix_suffix_attention_ref(q.float(), kp.float(), vp.float(), ks.float(), vs.float(), scale, cu)
    out = {
        "shape": f"{len(prompts)} prompt(s) of {prompts} tokens x W={width}, Ls={suffix}, {hq}/{hkv} heads, d={d}",
        "results": {},
    }
    r = out["results"]
    for bw, bn, warps, stages in (
        (16, 64, 4, 3),
        (16, 64, 4, 2),
        (8, 64, 4, 3),
        (4, 64, 4, 3),
        (32, 32, 4, 3),
        (16, 128, 8, 2),
    ):
        fn = lambda: prefix_suffix_attention(q, kp, vp, ks, vs, scale, cu, bw, bn, warps, stages)  # noqa: E731
        r[f"triton prefix {bw}x{bn} w{warps} s{stages}"] = timed(fn, ref)
    fn = lambda: prefix_suffix_attention_ref(q, kp, vp, ks, vs, scale, cu)  # noqa: E731
    r["reference"] = timed(fn, ref)

    # What a paged/copied cache does: each beam's prompt K/V copied next to its suffix, then SDPA.
    index = torch.repeat_interleave(torch.arange(len(prompts), device=dev), width)
    lmax = max(prompts)
    pos = torch.arange(lmax, device=dev)
    key_rows = (cu[:-1, None] + pos).clamp(max=t - 1)[index]  # [rows, lmax]
    valid = torch.cat(
        [
            pos[None, :] < torch.tensor(prompts, device=dev)[index][:, None],
            torch.ones(rows, suffix, dtype=torch.bool, device=dev),
        ],
        1,
    )[:, None, None, :]

    def concat_sdpa():
        k = torch.cat([kp[key_rows], ks], 1).transpose(1, 2)
        v = torch.cat([vp[key_rows], vs], 1).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid, enable_gqa=True)[:, :, 0]

    r["SDPA over prompt K/V copied per beam"] = timed(concat_sdpa, ref)
    return out


def rope(t: int, hq: int, hkv: int, d: int, norm: bool) -> dict:
    dev = "cuda"
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    angles = torch.rand(t, d // 2, device=dev) * 100
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    w = (torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5,) * 2 if norm else (None, None)
    ref = qkv_rope_ref(qkv.float(), cos.float(), sin.float(), hq, hkv, *(None if x is None else x.float() for x in w))[
        0
    ]
    inductor = torch.compile(lambda *a: [x.contiguous() for x in qkv_rope_ref(*a)], dynamic=False)
    r = {
        name: timed(lambda fn=fn: fn(qkv, cos, sin, hq, hkv, *w)[0], ref)  # all three outputs; error of q
        for name, fn in (("triton qkv_rope", qkv_rope), ("Inductor (torch.compile of the reference)", inductor))
    }
    return {"shape": f"{t} rows, {hq}/{hkv} heads, d={d}, QK-norm {norm}", "results": r}


def mlp_act(t: int, inner: int) -> dict:
    x = torch.randn(t, 2 * inner, device="cuda", dtype=torch.bfloat16) * 4
    ref = silu_mul_ref(x.float())
    inductor = torch.compile(silu_mul_ref, dynamic=False)
    return {
        "shape": f"{t} rows, [T, {2 * inner}] -> [T, {inner}]",
        "results": {
            "triton silu_mul": timed(lambda: silu_mul(x), ref),
            "Inductor (torch.compile of the reference)": timed(lambda: inductor(x), ref),
        },
    }


def topk(rows: int, k: int, vocab: int = 151936) -> dict:
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    ref = logits.float().topk(k, dim=-1).values
    r = {"torch.topk (one pass)": timed(lambda: logits.topk(k, dim=-1).values, ref)}
    unsorted = torch.compile(lambda x: (x.topk(k, dim=-1, sorted=False), torch.logsumexp(x.float(), -1)))
    fn = lambda: unsorted(logits)[0].values  # noqa: E731
    r["torch.topk unsorted + logsumexp (compiled; the graphs' reference path)"] = {
        "eager_call_ms": median_ms(fn),
        "gpu_ms": graph_ms(fn),
        "rel_err": rel_err(fn().sort(-1, descending=True).values, ref),
    }
    for group in (16, 32):  # the graphs': 32
        name = f"triton vocab_topk (group maxima + logsumexp), group {group}"
        fused = lambda g=group: vocab_topk(logits, k, group=g)  # noqa: E731
        try:  # a failure is reported, the rest of the bench goes on
            r[name] = {
                "eager_call_ms": median_ms(fused),
                "gpu_ms": graph_ms(fused),
                "rel_err": rel_err(fused()[0].sort(-1, descending=True).values, ref),
            }
        except Exception as e:
            r[name] = {
                "eager_call_ms": float("nan"),
                "gpu_ms": float("nan"),
                "rel_err": float("nan"),
                "error": f"{type(e).__name__}: {e}"[:300],
            }
    return {"shape": f"{rows} rows x {vocab}, k={k}", "results": r}


def selections(rows: int, columns: int, k: int) -> dict:
    """One of a beam step's row top-k's, alone (the places the search derives from them are the same
    whichever top-k): per prompt its best 2W of W x 2W continuations (fp32), its running beams (W
    of 2W) or its finished pool's merge (W of 3W), through torch.topk and through row_topk. Eager
    calls replayed from a CUDA graph: nothing to compile."""
    x = torch.randn(rows, columns, device="cuda") * 3 - 20
    ref = x.topk(k, dim=1).values
    variants = {
        "torch.topk sorted": lambda: x.topk(k, dim=1),
        "torch.topk unsorted (the graphs' before row_topk)": lambda: x.topk(k, dim=1, sorted=False),
    }
    for block in (2048, 8192, 32768):  # 8192: the graphs'
        variants[f"row_topk, block {block}"] = lambda b=block: row_topk(x, k, block=b)
    r = {}
    for name, fn in variants.items():
        r[name] = timed(lambda f=fn: f()[0].sort(-1, descending=True).values, ref)
    return {"shape": f"{rows} row(s) x {columns}, k={k}", "results": r}


# a beam step's row top-k's: (columns per prompt, k) at width W
SELECTIONS = {
    "continuations": lambda w: (2 * w * w, 2 * w),
    "running beams": lambda w: (2 * w, w),
    "pool merge": lambda w: (3 * w, w),
}


def cases() -> dict:
    """Every case of the bench: its name and the call that measures it."""
    rng = random.Random(0)
    w1 = [rng.randint(64, 160) for _ in range(15)]
    w3 = [rng.randint(384, 512)]
    return {
        "W1 prefill": lambda: prefill(w1, 16, 8, 128),
        "W3 prefill": lambda: prefill(w3, 14, 2, 64),
        **{f"W3 decode step {s}": lambda s=s: decode(100, [448], s, 14, 2, 64) for s in (1, 4)},
        "W=400 decode": lambda: decode(400, [100], 4, 14, 2, 64),
        "W3 decode, 4 prompts in one call": lambda: decode(100, [384, 512, 401, 450], 3, 14, 2, 64),
        "W2 decode step 4": lambda: decode(100, [88], 4, 14, 2, 64),
        "W2 decode, 4 prompts in one call": lambda: decode(100, [48, 128, 90, 70], 3, 14, 2, 64),
        "W1 QK-norm + RoPE": lambda: rope(1640, 16, 8, 128, True),
        "W2 decode RoPE, 4 prompts": lambda: rope(400, 14, 2, 64, False),
        "W1 SiLU * up": lambda: mlp_act(1640, 3072),
        "W2 decode SiLU * up, 4 prompts": lambda: mlp_act(400, 4864),
        **{f"beam top-k, {rows} beams": lambda rows=rows: topk(rows, 200) for rows in (100, 400, 800)},
        **{
            f"beam {what}, W={w}, {b} prompt(s)": lambda w=w, b=b, size=size: selections(b, *size(w))
            for what, size in SELECTIONS.items()
            for w, b in ((100, 1), (100, 8), (400, 1))
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="run only the cases whose name holds this text")
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, case in cases().items():  # each case printed and saved as it ends: a cut-off run keeps them
        if args.only not in name:
            continue
        res = results[name] = case()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\n{name}: {res['shape']}")
        for k, v in res["results"].items():
            print(
                f"  {k:52s} GPU {v['gpu_ms']:7.3f} ms  eager call {v['eager_call_ms']:7.3f} ms  "
                f"rel err {v['rel_err']:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
