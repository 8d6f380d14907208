"""Triton kernels on the GPU at workload shapes: error against the fp32 reference, and time
against the alternatives available there. "gpu_ms" is the GPU time of one call replayed from a
CUDA graph, without launch overhead; "eager_call_ms" is one call from Python, launch included
(the compiled graphs launch from C++). The alternatives: for prefill the PyTorch reference, padded
flash SDPA with and without its pad/unpad, flash `varlen_attn` and compiled flex attention with a
precomputed document-causal block mask; for beam decode SDPA over the prompt K/V copied per beam;
for QK-norm + RoPE and SiLU * up what Inductor generates from the reference (what the graphs ran
before the kernels). Also the beam step's vocabulary top-k with its logsumexp: PyTorch's (one pass, or two
stages over chunks) against slm_kernels/vocab_topk.py.

    python -m bench.kernels_bench --out FILE.json [--only "selection"]
"""

import argparse
import contextlib
import json
import random

import torch
import torch.nn.functional as F

from slm_core.compile.beam_graph import places, top
from slm_kernels.attention_ref import packed_attention_ref, prefix_suffix_attention_ref, random_prefix_inputs
from slm_kernels.layer_ref import qkv_rope_ref, silu_mul_ref
from slm_kernels.packed_attention import packed_attention
from slm_kernels.prefix_attention import prefix_suffix_attention
from slm_kernels.qkv_rope import qkv_rope
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


def two_stage_topk(x: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact row-wise top-k as the top k of each of `chunks` column chunks, then of those."""
    rows, v = x.shape
    vals, ids = x.view(rows, chunks, v // chunks).topk(k, dim=-1)
    ids = ids + torch.arange(0, v, v // chunks, device=x.device)[:, None]
    top, at = vals.flatten(1).topk(k, dim=-1)
    return top, ids.flatten(1).gather(1, at)


def topk(rows: int, k: int, vocab: int = 151936) -> dict:
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    ref = logits.float().topk(k, dim=-1).values
    r = {"torch.topk (one pass)": timed(lambda: logits.topk(k, dim=-1).values, ref)}
    both = torch.compile(lambda x: (x.topk(k, dim=-1), torch.logsumexp(x.float(), -1)))
    r["torch.topk + logsumexp (compiled)"] = timed(lambda: both(logits)[0].values, ref)
    unsorted = torch.compile(lambda x: (x.topk(k, dim=-1, sorted=False), torch.logsumexp(x.float(), -1)))
    fn = lambda: unsorted(logits)[0].values  # noqa: E731
    r["torch.topk unsorted + logsumexp (compiled; the graphs' default)"] = {
        "eager_call_ms": median_ms(fn),
        "gpu_ms": graph_ms(fn),
        "rel_err": rel_err(fn().sort(-1, descending=True).values, ref),
    }
    for group in (16, 32, 64, 128):  # the default is 32
        name = f"triton vocab_topk (group maxima + logsumexp, top-k of the best groups), group {group}"
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
    for chunks in (16, 64, 128):
        if vocab % chunks == 0 and vocab // chunks >= k:
            r[f"two stages, {chunks} chunks"] = timed(lambda c=chunks: two_stage_topk(logits, k, c)[0], ref)
    # The log-probabilities of the top ids, compiled as in the graphs: before and after this change.
    ids = logits.topk(k, dim=-1).indices
    want = torch.log_softmax(logits.float(), -1).gather(1, ids)
    gather = torch.compile(lambda x, i: torch.log_softmax(x.float(), -1).gather(1, i))
    lse = torch.compile(lambda x, i: x.gather(1, i).float() - torch.logsumexp(x.float(), -1, keepdim=True))
    r["log-probs of the top ids: log_softmax fp32 + gather (compiled)"] = timed(lambda: gather(logits, ids), want)
    r["log-probs of the top ids: logits - logsumexp (compiled)"] = timed(lambda: lse(logits, ids), want)
    return {"shape": f"{rows} rows x {vocab}, k={k}", "results": r}


def two_level_top(x: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """beam_graph.top (unsorted top k with places) by way of each of `chunks` column chunks' top k:
    exact, and torch.topk takes a row of fewer columns in one block instead of its multi-block
    radix select (a [1, 20,000] row, W2's, is just at that threshold)."""
    rows, m = x.shape
    part = m // chunks
    vals, ids = x.view(rows, chunks, part).topk(k, dim=-1, sorted=False)
    ids = ids + torch.arange(0, m, part, device=x.device)[:, None]
    values, at = vals.flatten(1).topk(k, dim=-1, sorted=False)
    idx = ids.flatten(1).gather(1, at)
    return values, idx, places(values, idx)


def selection(prompts: int, width: int) -> dict:
    """A beam step's selection: per prompt the top 2W of its W x 2W continuations (fp32) and their
    places, compiled as in the graphs."""
    k = 2 * width
    x = torch.randn(prompts, width * k, device="cuda") * 3 - 20
    ref = x.topk(k, dim=1).values
    variants = {
        "torch.topk sorted (the graphs before)": torch.compile(lambda x: x.topk(k, dim=1)),
        "beam_graph.top: unsorted + places (the graphs')": torch.compile(lambda x: top(x, k)),
    }
    for chunks in (2, 4, 8):
        if (width * k) % chunks == 0 and (width * k) // chunks >= k:
            variants[f"two levels, {chunks} chunks, + places"] = torch.compile(
                lambda x, c=chunks: two_level_top(x, k, c)
            )
    r = {}
    for name, fn in variants.items():
        call = lambda f=fn: f(x)  # noqa: E731
        r[name] = {
            "eager_call_ms": median_ms(call),
            "gpu_ms": graph_ms(call),
            "rel_err": rel_err(call()[0].sort(-1, descending=True).values, ref),
        }
    return {"shape": f"{prompts} prompt(s) x {width * k} continuations, k={k}", "results": r}


def counted_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=1) of a short row, sorted (equal values by index; NaN above all, as there),
    with no top-k kernel: each value's place is how many values beat it ([B, M, M]), and the first
    k places are scattered out (a place past k to a spare column)."""
    rows, m = x.shape
    idx = torch.arange(m, device=x.device)
    a, b, nan_a, nan_b = x[:, None, :], x[:, :, None], x.isnan()[:, None, :], x.isnan()[:, :, None]
    above, tied = (a > b) | (nan_a & ~nan_b), (a == b) | (nan_a & nan_b)
    place = (above | (tied & (idx[None, None, :] < idx[None, :, None]))).sum(2).clamp_max(k)
    values = torch.full((rows, k + 1), float("nan"), device=x.device).scatter(1, place, x)[:, :k]
    ids = torch.zeros(rows, k + 1, dtype=torch.int64, device=x.device).scatter(1, place, idx.expand(rows, m))[:, :k]
    return values, ids


def small_selection(prompts: int, width: int, columns: int) -> dict:
    """A short sorted top-k of a beam step's size: the finished pool's merge (W of 3W per prompt,
    torch.topk sorted in the graphs) or the running beams' (W of 2W; the graphs take beam_graph.top),
    torch.topk against counting places."""
    x = torch.randn(prompts, columns, device="cuda") * 3 - 20
    ref = x.topk(width, dim=1).values
    r = {}
    for name, fn in {
        "torch.topk sorted": torch.compile(lambda x: x.topk(width, dim=1)),
        "counted places, scattered": torch.compile(lambda x: counted_top(x, width)),
    }.items():
        r[name] = timed(lambda f=fn: f(x)[0], ref)
    return {"shape": f"{prompts} prompt(s) x {columns}, k={width}", "results": r}


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
            f"beam selection, W={w}, {b} prompt(s)": lambda w=w, b=b: selection(b, w)
            for w, b in ((100, 1), (100, 4), (100, 8), (400, 1))
        },
        **{
            f"beam {what}, W={w}, {b} prompt(s)": lambda w=w, b=b, n=n: small_selection(b, w, n * w)
            for what, n in (("running beams", 2), ("pool merge", 3))
            for w, b in ((100, 1), (100, 8), (400, 1))
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="run only the cases whose name holds this text")
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results.update({name: case() for name, case in cases().items() if args.only in name})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for name, res in results.items():
        if isinstance(res, dict):
            print(f"\n{name}: {res['shape']}")
            for k, v in res["results"].items():
                print(
                    f"  {k:52s} GPU {v['gpu_ms']:7.3f} ms  eager call {v['eager_call_ms']:7.3f} ms  "
                    f"rel err {v['rel_err']:.2e}"
                )


if __name__ == "__main__":
    main()
