"""A beam decode step at W2's shapes, in process (no archive): the instrument for making it fast.

For rows = the beams of 1, 2, 4, 8 W2 prompts (100 each), on W2's model (Qwen2.5-0.5B, random
bf16 weights), it reports per variant:
- the decode layer-step: µs per layer (the 24 layers' decode over their own weights, so each
  layer's weights come from HBM as in the graphs, divided by 24), kernels per layer, and the
  weight-read floor beside it: the layer's weight bytes over the HBM read rate this run measures
  (a reduction over 2 GiB);
- the whole decode step: the 24 layers, the final norm and LM head over the beams, and the
  vocabulary top-2W with its log-sum-exp (slm_kernels.vocab_topk), with its floor.
Each variant is the model's own decode code compiled by Inductor (default configs, dynamic rows),
replayed from a CUDA graph; kernels are counted by the profiler over replays. One step compiled
alone keeps its suffix K/V concatenation as kernels of its own, which the beam graph fuses into
the next step's reordering gather: those kernels are listed, and count here, not there.
Variants:
- "bf16": the graphs' decode (the Triton attention, QK-norm + RoPE and SiLU * up kernels,
  cuBLAS projections);
- "fp8-static": the same as "bf16" with qkv, gate/up and down in E4M3 with one scale per tensor
  (slm_core.compile.fp8), the input scales calibrated on the bench's own inputs.
Before the variants, each projection alone with its weights cold (from HBM) and hot (from L2: what
weights already in L2 can save a GEMM at most).
A candidate joins as another variant: a function of the bf16 model that returns the model to time.

    python -m bench.step_bench --out FILE.json [--rows 100,200,400,800] [--variants "bf16,fp8-static"]
"""

import argparse
import json

import torch

from bench.kernels_bench import graph_ms
from bench.workloads import QWEN25_05B
from slm_core.compile.fp8 import calibrate, quantize_linears
from slm_core.compile.model import Transformer
from slm_core.spec import ModelSpec

WIDTH, PROMPT, SUFFIX = 100, 88, 2  # W2: W = 100, prompts of 48-128 tokens; the third of 5 new tokens
W2 = ModelSpec.from_hf_config(QWEN25_05B)  # W2's model (bench.workloads)


def hbm_gb_per_s() -> float:
    """HBM read rate of a reduction over 2 GiB: what streaming weights through the SMs can reach (a
    copy inside a CUDA graph runs on a copy engine, slower than the SMs)."""
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    return src.numel() * 2 / graph_ms(lambda: src.sum(dtype=torch.float32), calls=5, replays=10) / 1e6


def random_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer.empty(W2, 4096, torch.bfloat16, "cuda", kernels="triton")
    for name, p in model.named_parameters():
        p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.02)
    return model


def step_inputs(model: Transformer, rows: int, dev: str = "cuda") -> tuple:
    """A decode step's inputs for rows // WIDTH prompts of PROMPT tokens: last tokens, positions,
    each layer's prompt K/V, the prompts' boundaries and each layer's suffix K/V."""
    s, dtype = model.spec, model.norm.weight.dtype
    torch.manual_seed(rows)  # the same inputs for every variant
    prompts = rows // WIDTH
    kv = (s.num_kv_heads, s.head_dim)
    prefix = [tuple(torch.randn(prompts * PROMPT, *kv, device=dev, dtype=dtype) for _ in "kv") for _ in model.layers]
    suffix = [tuple(torch.randn(rows, SUFFIX, *kv, device=dev, dtype=dtype) for _ in "kv") for _ in model.layers]
    ids = torch.randint(0, s.vocab_size, (rows,), device=dev)
    positions = torch.full((rows,), PROMPT + SUFFIX, device=dev)
    cu = torch.arange(prompts + 1, device=dev, dtype=torch.int32) * PROMPT
    return ids, positions, prefix, cu, suffix


def fp8_static(model: Transformer) -> Transformer:
    """model with qkv, gate/up and down in E4M3 (in place), input scales from a bf16 decode step."""
    amax = calibrate(model, lambda: [model.decode(*step_inputs(model, rows)) for rows in (100, 400)])
    quantize_linears(model, amax, triton=True)
    return model


# a layer's projections, as the graphs run them (cuBLAS through nn.Linear)
PROJECTIONS = {
    "qkv": lambda layer: layer.attn.qkv,
    "o": lambda layer: layer.attn.o,
    "gate_up": lambda layer: layer.mlp.gate_up,
    "down": lambda layer: layer.mlp.down,
}


def projection_probe(model: Transformer, rows_list: list[int], gbps: float) -> dict:
    """Each projection alone, µs per layer and its kernels:
    - cold: over the 24 layers' weights in turn (from HBM, as a decode step reads them);
    - hot: over one layer's weights 24 times (from L2 after the first): what weights already in L2
      could save a GEMM."""
    out: dict = {}
    n = len(model.layers)
    for name, get in PROJECTIONS.items():
        linears = [get(layer) for layer in model.layers]
        for rows in rows_list:
            x = torch.randn(rows, linears[0].in_features, device=model.norm.weight.device, dtype=torch.bfloat16)
            out.setdefault(name, {})[rows] = {
                "cold_us": graph_ms(lambda: [lin(x) for lin in linears], calls=5) * 1e3 / n,
                "hot_us": graph_ms(lambda: [linears[0](x) for _ in linears], calls=5) * 1e3 / n,
                "kernels": kernels_per_call(lambda: [lin(x) for lin in linears], calls=2)[1][:2],
                "floor_us": weight_bytes(linears[0]) / gbps / 1e3,
            }
    return out


def kernels_per_call(fn, calls: int = 5) -> tuple[float, list]:
    """Kernels per call of fn replayed from a CUDA graph, and each kernel's GPU µs and launches per call."""
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


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in [*module.parameters(), *module.buffers()]
        if t.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    )


def step_layers(model: Transformer):
    """A decode step's layers and the final norm, as the graphs run them before the LM head. The
    norm is there for Inductor's sake: with the last residual add consumed by an elementwise
    kernel, every residual add stays out of its GEMM, as in the graphs; returned bare, the last
    one is fused into its GEMM (addmm), and so is every one before it."""

    def layers(ids, pos, prefix, cu, suffix):
        return model.norm(model.decode(ids, pos, prefix, cu, suffix)[0])

    return layers


def measure(model: Transformer, rows_list: list[int], gbps: float, compiled: bool = True) -> dict:
    """The layer-step and the whole step of model at each row count; the layers compiled by
    Inductor, or eager (compiled=False: each op its own kernels, still replayed from a CUDA graph)."""
    from slm_kernels.vocab_topk import vocab_topk

    decode = step_layers(model)
    layers = torch.compile(decode, dynamic=True, fullgraph=True) if compiled else decode
    head = torch.compile(lambda normed: vocab_topk(model.lm_head(normed), 2 * WIDTH), dynamic=True, fullgraph=True)
    n, layer = len(model.layers), weight_bytes(model.layers[0])
    out = {}
    for rows in rows_list:
        args = step_inputs(model, rows)
        hidden = layers(*args)
        kernels, top = kernels_per_call(lambda: layers(*args))
        step_kernels, _ = kernels_per_call(lambda: head(layers(*args)))
        out[rows] = {
            "layer_us": graph_ms(lambda: layers(*args), calls=5) * 1e3 / n,
            "layer_kernels": kernels / n,
            "layer_floor_us": layer / gbps / 1e3,
            "step_us": graph_ms(lambda: head(layers(*args)), calls=5) * 1e3,
            "step_kernels": step_kernels,
            "step_floor_us": (n * layer + model.lm_head.weight.numel() * 2) / gbps / 1e3,
            "kernels_per_layer_us": [(us / n, count / n, name) for us, count, name in top[:16]],
            "hidden": hidden.float(),
        }
    return out


# name: the model to time, from the bf16 model
VARIANTS = {
    "bf16": lambda model: model,
    "fp8-static": fp8_static,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="100,200,400,800")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which VARIANTS, comma-separated")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch._dynamo.config.cache_size_limit = 64
    gbps = hbm_gb_per_s()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "hbm_GB_per_s": gbps,
        "rows": rows_list,
        "variants": {},
    }
    print(f"HBM read rate {gbps:.0f} GB/s")
    results["projections"] = projection_probe(random_model(), rows_list, gbps)
    print("each projection alone, us per layer: weights cold (HBM) / hot (L2) / floor")
    for name, per_rows in results["projections"].items():
        for r, t in per_rows.items():
            print(
                f"  {name:8s} {r:4d} rows {t['cold_us']:6.2f} / {t['hot_us']:6.2f} / {t['floor_us']:4.2f}   "
                f"{t['kernels'][0][2][:60]}"
            )
    reference: dict[int, torch.Tensor] = {}
    for name, make in VARIANTS.items():
        if name not in args.variants.split(","):
            continue
        variant = make(random_model())  # the same weights each time (seeded); a variant changes them in place
        try:
            out = measure(variant, rows_list, gbps)
        except Exception as e:  # a variant that does not compile is reported, and measured eager
            print(f"\n{name}: {type(e).__name__}: {str(e)[:2000]}")
            results["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            name += " (eager)"
            try:
                out = measure(variant, rows_list, gbps, compiled=False)
            except Exception as e:  # nor runs eager: reported, the rest go on
                results["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(f"\n{name}: {results['variants'][name]['error']}")
                continue
        print(f"\n{name}")
        for rows, r in out.items():
            hidden = r.pop("hidden")
            base = reference.setdefault(rows, hidden)
            r["hidden_rel_err_vs_bf16"] = ((hidden - base).norm() / base.norm()).item()
            print(
                f"  {rows:4d} rows: layer-step {r['layer_us']:6.2f} us in {r['layer_kernels']:5.2f} kernels "
                f"(floor {r['layer_floor_us']:.2f}); whole step {r['step_us']:7.1f} us in {r['step_kernels']:6.1f} "
                f"kernels (floor {r['step_floor_us']:.1f}); hidden vs bf16 {r['hidden_rel_err_vs_bf16']:.1e}"
            )
        for us, count, kname in out[rows_list[0]]["kernels_per_layer_us"]:
            print(f"      {us:6.2f} us {count:5.2f}x  {kname}")
        results["variants"][name] = out
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
