"""A beam decode step at W2's shapes, in process (no archive): the instrument for making it fast.

For rows = the beams of 1, 2, 4, 8 W2 prompts (100 each), on W2's model (Qwen2.5-0.5B, random
bf16 weights), it reports per variant:
- the decode layer-step: µs per layer (the 24 layers' decode over their own weights, so each
  layer's weights come from HBM as in the graphs, divided by 24), kernels per layer, and the
  weight-read floor beside it: the layer's weight bytes over the HBM rate this run measures;
- the whole decode step: the 24 layers, the final norm and LM head over the beams, and the
  vocabulary top-2W with its log-sum-exp (slm_kernels.vocab_topk), with its floor.
Each variant is the model's own decode code compiled by Inductor as the graphs are (default
configs, dynamic rows), replayed from a CUDA graph; kernels are counted by the profiler over
replays. The variants differ in the Ops the blocks' decode runs:
- "separate kernels": each projection in cuBLAS, with the norm before it (Inductor), QK-norm +
  RoPE (slm_kernels.qkv_rope) and SiLU * up (slm_kernels.silu_mul) as kernels of their own;
- "decode_linear": slm_kernels.decode_linear, each projection with the work around it, at the
  kernels' default tilings, and at the tilings the sweep found best (--sweep).
The sweep times each decode projection alone at each row count (24 weights in turn, from HBM),
cuBLAS and the separate kernels against decode_linear's tilings.

    python -m bench.step_bench --out FILE.json [--rows 100,200,400,800] [--sweep]
"""

import argparse
import functools
import json

import torch

from bench.kernels_bench import graph_ms
from slm_core.build.model import Ops, Transformer, separate_decode, triton_ops
from slm_core.spec import ModelSpec, RopeSpec

WIDTH, PROMPT, SUFFIX = 100, 88, 2  # W2: W = 100, prompts of 48-128 tokens; the third of 5 new tokens
W2 = ModelSpec(arch="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
               head_dim=64, intermediate_size=4864, rms_norm_eps=1e-6, rope=RopeSpec(theta=1e6),
               tie_word_embeddings=True, qkv_bias=True)


def hbm_gb_per_s() -> float:
    """HBM rate of a 2 GiB device-to-device copy, counting its reads and writes."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / graph_ms(lambda: dst.copy_(src), calls=5, replays=10) / 1e6


def random_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer.empty(W2, 4096, torch.bfloat16, "cuda", kernels="triton")
    for name, p in model.named_parameters():
        p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.02)
    return model


def step_inputs(model: Transformer, rows: int) -> tuple:
    """A decode step's inputs for rows // WIDTH prompts of PROMPT tokens: last tokens, positions,
    each layer's prompt K/V and suffix K/V, the prompts' boundaries."""
    s, dev = model.spec, "cuda"
    torch.manual_seed(rows)  # the same inputs for every variant
    prompts = rows // WIDTH
    kv = (s.num_kv_heads, s.head_dim)
    prefix = [tuple(torch.randn(prompts * PROMPT, *kv, device=dev, dtype=torch.bfloat16) for _ in "kv")
              for _ in model.layers]
    suffix = [tuple(torch.randn(rows, SUFFIX, *kv, device=dev, dtype=torch.bfloat16) for _ in "kv")
              for _ in model.layers]
    ids = torch.randint(0, s.vocab_size, (rows,), device=dev)
    positions = torch.full((rows,), PROMPT + SUFFIX, device=dev)
    cu = torch.arange(prompts + 1, device=dev, dtype=torch.int32) * PROMPT
    return ids, positions, prefix, cu, suffix


def kernels_per_call(fn, calls: int = 5) -> tuple[float, list]:
    """Kernels per call of fn replayed from a CUDA graph, and the GPU µs per call of each."""
    graph = torch.cuda.CUDAGraph()
    fn()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(((e.self_device_time_total / calls, e.count / calls, e.key[:90]) for e in events), reverse=True)
    return sum(e.count for e in events) / calls, rows


def layer_bytes(spec: ModelSpec) -> int:
    s = spec
    qkv = (s.q_size + 2 * s.kv_size) * (s.hidden_size + s.qkv_bias)
    return 2 * (qkv + s.q_size * s.hidden_size + 3 * s.intermediate_size * s.hidden_size + 2 * s.hidden_size)


def measure(model: Transformer, rows_list: list[int], gbps: float, ops: Ops, head) -> dict:
    """The layer-step and the whole step of model with `ops`, at each row count; head: the
    compiled LM head and vocabulary top-k, the step's end."""
    for layer in model.layers:
        layer.ops = ops
    layers = torch.compile(lambda ids, pos, prefix, cu, suffix: model.decode(ids, pos, prefix, cu, suffix)[0],
                           dynamic=True, fullgraph=True)
    out, n = {}, len(model.layers)
    layer_floor = layer_bytes(model.spec) / gbps / 1e3
    step_floor = (n * layer_bytes(model.spec) + model.lm_head.weight.numel() * 2) / gbps / 1e3
    for rows in rows_list:
        args = step_inputs(model, rows)
        hidden = layers(*args)
        kernels, top = kernels_per_call(lambda: layers(*args))
        step_kernels, _ = kernels_per_call(lambda: head(layers(*args)))
        out[rows] = {"layer_us": graph_ms(lambda: layers(*args), calls=5) * 1e3 / n, "layer_kernels": kernels / n,
                     "layer_floor_us": layer_floor, "step_us": graph_ms(lambda: head(layers(*args)), calls=5) * 1e3,
                     "step_kernels": step_kernels, "step_floor_us": step_floor,
                     "kernels_per_layer_us": [(us / n, count / n, name) for us, count, name in top[:16]],
                     "hidden": hidden.float()}
    return out


def lm_head_topk(model: Transformer):
    """The step's end as the beam graph runs it: final norm, LM head, top-2W with log-sum-exp."""
    from slm_kernels.vocab_topk import vocab_topk

    return torch.compile(lambda hidden: vocab_topk(model.logits(hidden), 2 * WIDTH), dynamic=True, fullgraph=True)


# --- the sweep: each decode projection alone ---------------------------------------------------------
def tilings(op: str) -> list[dict]:
    """decode_linear tilings the sweep tries for W2's op: a few around each kernel's default."""
    t = dict(block_m=64, block_k=64, swap=False, num_stages=3)
    swapped = dict(block_m=128, swap=True)
    if op == "gate_up":
        t.update(block_n=32, splits=1)
        return [t, dict(t, block_k=128), dict(t, block_n=64), dict(t, num_stages=4), dict(t, splits=2),
                dict(t, block_m=128), dict(t, **swapped), dict(t, **swapped, block_n=64), dict(t, **swapped, splits=2),
                dict(t, **swapped, block_k=128)]
    if op == "qkv":
        t.update(block_k=128, splits=7)
        return [t, dict(t, block_k=64, splits=14), dict(t, splits=4), dict(t, **swapped),
                dict(t, **swapped, block_k=64, splits=14), dict(t, num_stages=2)]
    splits = (7, 14) if op == "o" else (8, 19)
    return [dict(t, block_n=bn, splits=sp, **extra) for bn in (32, 64) for sp in splits for extra in ({}, swapped)]


SWEPT = {  # name: (op, out features, in features)
    "qkv": ("norm_qkv_rope", W2.q_size + 2 * W2.kv_size, W2.hidden_size),
    "o": ("linear_residual", W2.hidden_size, W2.q_size),
    "gate_up": ("norm_gate_up_silu", 2 * W2.intermediate_size, W2.hidden_size),
    "down": ("linear_residual", W2.hidden_size, W2.intermediate_size),
}


def sweep(rows_list: list[int], gbps: float) -> dict:
    """Each decode projection of W2 alone at each row count: the separate kernels and decode_linear's
    tilings, over 24 weights in turn (from HBM as in the graphs). Per case each variant's µs and
    error against the separate kernels per row count."""
    from slm_kernels import decode_linear

    s, dev, dt = W2, "cuda", torch.bfloat16
    separate = separate_decode(triton_ops(W2))
    counters = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    results = {}
    for name, (op, n, k) in SWEPT.items():
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(24)]
        bias = torch.randn(n, device=dev, dtype=dt) * 0.02 if name == "qkv" else None
        norm_w = torch.rand(k, device=dev, dtype=dt) + 0.5
        compiled = torch.compile(getattr(separate, op), dynamic=True)
        variants = {"separate kernels (cuBLAS)": compiled}
        variants.update({json.dumps(t, sort_keys=True): functools.partial(getattr(decode_linear, op), **t)
                         for t in tilings(name)})
        case = results[name] = {"floor_us": n * k * 2 / gbps / 1e3, "variants": {}}
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=dt)
            angles = torch.rand(rows, s.head_dim // 2, device=dev) * 100
            cos, sin = (torch.cat([f(angles)] * 2, -1).to(dt) for f in (torch.cos, torch.sin))
            res = torch.randn(rows, n, device=dev, dtype=dt)
            before = {"norm_qkv_rope": lambda w: (x, norm_w, w, bias, cos, sin, s.num_heads, s.num_kv_heads, None,
                                                  None, s.rms_norm_eps),
                      "linear_residual": lambda w: (x, w, None, res),
                      "norm_gate_up_silu": lambda w: (x, norm_w, w, None, s.rms_norm_eps)}[op]
            ref = outputs(compiled(*before(weights[0]), counters=counters))
            for label, fn in variants.items():
                cell = case["variants"].setdefault(label, {})
                try:
                    err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in zip(outputs(fn(*before(weights[0]), counters=counters)), ref))
                    us = graph_ms(lambda: [fn(*before(w), counters=counters) for w in weights], calls=1)
                    cell[rows] = {"us": us * 1e3 / len(weights), "rel_err": err}
                except Exception as e:  # a tiling this GPU cannot run is reported, the sweep goes on
                    cell[rows] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print_case(name, case, rows_list)
    return results


def outputs(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def print_case(name: str, case: dict, rows_list: list[int]) -> None:
    ranked = sorted(case["variants"].items(), key=lambda kv: total_us(kv[1], rows_list))
    print(f"\n{name}: weight-read floor {case['floor_us']:.2f} us; us at rows {rows_list}")
    for label, v in ranked:
        cells = " ".join(f"{v[r]['us']:7.2f}" if "us" in v.get(r, {}) else "    err" for r in rows_list)
        err = max((v[r].get("rel_err", 0) for r in rows_list if r in v), default=0)
        print(f"  {cells}  err {err:.1e}  {label}")


def total_us(variant: dict, rows_list: list[int]) -> float:
    return sum(variant.get(r, {}).get("us", float("inf")) for r in rows_list)


def best_tilings(results: dict, rows_list: list[int]) -> dict[str, dict]:
    """Per projection, the tiling with the least time summed over the row counts (a graph takes one
    for every row count)."""
    return {name: json.loads(min((label for label in case["variants"] if not label.startswith("separate")),
                                 key=lambda label: total_us(case["variants"][label], rows_list)))
            for name, case in results.items()}


def with_tilings(ops: Ops, best: dict[str, dict]) -> Ops:
    """ops whose decode linears take these tilings (o and down told apart by their in features)."""
    o, down = (functools.partial(ops.linear_residual, **best[n]) for n in ("o", "down"))
    return ops._replace(
        norm_qkv_rope=functools.partial(ops.norm_qkv_rope, **best["qkv"]),
        linear_residual=lambda x, *args, **kw: (down if x.shape[1] == W2.intermediate_size else o)(x, *args, **kw),
        norm_gate_up_silu=functools.partial(ops.norm_gate_up_silu, **best["gate_up"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="100,200,400,800")
    p.add_argument("--sweep", action="store_true", help="time each projection's tilings first, and run the best")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch._dynamo.config.cache_size_limit = 64
    gbps = hbm_gb_per_s()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_GB_per_s": gbps,
               "rows": rows_list, "variants": {}}
    print(f"HBM copy rate {gbps:.0f} GB/s")
    variants = {"separate kernels": separate_decode(triton_ops(W2)), "decode_linear, default tilings": triton_ops(W2)}
    if args.sweep:
        results["sweep"] = sweep(rows_list, gbps)
        results["best_tilings"] = best = best_tilings(results["sweep"], rows_list)
        print("best tilings:", json.dumps(best))
        variants["decode_linear, the sweep's tilings"] = with_tilings(triton_ops(W2), best)
    model = random_model()
    head = lm_head_topk(model)
    reference: dict[int, torch.Tensor] = {}
    for name, ops in variants.items():
        try:
            out = measure(model, rows_list, gbps, ops, head)
        except Exception as e:  # a variant that does not compile or capture is reported, the rest go on
            results["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"\n{name}: {results['variants'][name]['error']}")
            continue
        print(f"\n{name}")
        for rows, r in out.items():
            hidden = r.pop("hidden")
            base = reference.setdefault(rows, hidden)
            r["hidden_rel_err_vs_separate"] = ((hidden - base).norm() / base.norm()).item()
            print(f"  {rows:4d} rows: layer-step {r['layer_us']:6.2f} us in {r['layer_kernels']:5.2f} kernels "
                  f"(floor {r['layer_floor_us']:.2f}); whole step {r['step_us']:7.1f} us in {r['step_kernels']:6.1f} "
                  f"kernels (floor {r['step_floor_us']:.1f}); hidden vs separate {r['hidden_rel_err_vs_separate']:.1e}")
        for us, count, kname in out[rows_list[0]]["kernels_per_layer_us"]:
            print(f"      {us:6.2f} us {count:5.2f}x  {kname}")
        results["variants"][name] = out
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
