"""Attention kernels on the GPU at workload shapes: error against the fp32 reference, and median
time against the alternatives available there (the PyTorch reference as compiled into today's
graphs is eager here; padded flash SDPA including its pad/unpad; SDPA over concatenated K/V).

    python -m bench.kernels_bench --out FILE.json
"""

import argparse
import json
import random

import torch
import torch.nn.functional as F

from kernels.attention_ref import packed_attention_ref, prefix_suffix_attention_ref
from kernels.packed_attention import packed_attention
from kernels.prefix_attention import prefix_suffix_attention


def median_ms(fn, iters: int = 50) -> float:
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
    for bm, bn in ((64, 64), (128, 64), (64, 32)):
        fn = lambda: packed_attention(q, k, v, cu, scale, max(lengths), bm, bn)  # noqa: E731
        r[f"triton packed {bm}x{bn}"] = {"ms": median_ms(fn), "rel_err": rel_err(fn(), ref)}
    r["reference (eager, dense mask)"] = {"ms": median_ms(lambda: packed_attention_ref(q, k, v, cu, scale)),
                                          "rel_err": rel_err(packed_attention_ref(q, k, v, cu, scale), ref)}

    def padded():  # pad to [N, H, Lmax, D], flash SDPA (GQA), unpad
        lmax, n = max(lengths), len(lengths)
        idx = torch.cat([torch.arange(a, a + n_, device=dev) for a, n_ in zip(cu[:-1].tolist(), lengths)])
        pos = torch.cat([torch.arange(n_, device=dev) + i * lmax for i, n_ in enumerate(lengths)])
        pad = lambda x: x.new_zeros(n * lmax, x.shape[1], d).index_copy_(0, pos, x[idx]).view(n, lmax, -1, d)  # noqa: E731
        o = F.scaled_dot_product_attention(pad(q).transpose(1, 2), pad(k).transpose(1, 2), pad(v).transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(n * lmax, hq, d)[pos]

    r["padded flash SDPA incl. pad/unpad"] = {"ms": median_ms(padded), "rel_err": rel_err(padded(), ref)}
    return out


def decode(width: int, prompt: int, suffix: int, hq: int, hkv: int, d: int) -> dict:
    dev, scale = "cuda", d**-0.5
    q = torch.randn(width, hq, d, device=dev, dtype=torch.bfloat16)
    kp, vp = (torch.randn(prompt, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ks, vs = (torch.randn(width, suffix, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ref = prefix_suffix_attention_ref(q.float(), kp.float(), vp.float(), ks.float(), vs.float(), scale)
    out = {"shape": f"W={width}, Lp={prompt}, Ls={suffix}, {hq}/{hkv} heads, d={d}", "results": {}}
    r = out["results"]
    for bw, bn in ((16, 64), (8, 64), (32, 32)):
        fn = lambda: prefix_suffix_attention(q, kp, vp, ks, vs, scale, bw, bn)  # noqa: E731
        r[f"triton prefix {bw}x{bn}"] = {"ms": median_ms(fn), "rel_err": rel_err(fn(), ref)}
    fn = lambda: prefix_suffix_attention_ref(q, kp, vp, ks, vs, scale)  # noqa: E731
    r["reference (eager)"] = {"ms": median_ms(fn), "rel_err": rel_err(fn(), ref)}

    def concat_sdpa():  # what a paged/copied cache does: the prompt K/V per beam, then SDPA
        k = torch.cat([kp.expand(width, -1, -1, -1), ks], 1).transpose(1, 2)
        v = torch.cat([vp.expand(width, -1, -1, -1), vs], 1).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

    r["SDPA over prompt K/V copied per beam"] = {"ms": median_ms(concat_sdpa), "rel_err": rel_err(concat_sdpa(), ref)}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = random.Random(0)
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "W1 prefill": prefill([rng.randint(64, 160) for _ in range(15)], 16, 8, 128),
        "W3 prefill": prefill([rng.randint(384, 512)], 14, 2, 64),
        **{f"W3 decode step {s}": decode(100, 448, s, 14, 2, 64) for s in (1, 4)},
        "W=400 decode": decode(400, 100, 4, 14, 2, 64),
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for name, res in results.items():
        if isinstance(res, dict):
            print(f"\n{name}: {res['shape']}")
            for k, v in res["results"].items():
                print(f"  {k:40s} {v['ms']:8.3f} ms   rel err {v['rel_err']:.2e}")


if __name__ == "__main__":
    main()
