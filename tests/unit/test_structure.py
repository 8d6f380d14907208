"""Structural properties of the graphs: no padding, the prompt K/V shared by all beams, export
with dynamic shapes, bit-identical repeats, and bf16 close to fp32."""

import contextlib

import pytest
import torch
from conftest import CHAT
from helpers import engine_for, text_ids
from test_hf_equality import TEXTS

import slm_core.compile.model
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.compile.export import export_graph

SCORE = dict(task="score", labels=["yes", "no"], max_texts=6, max_text_tokens=48)
BEAM = dict(task="beam", beam_width=4, new_tokens=4, max_prompt_tokens=48)
TEXTS_RANDOM = ["a", "search engines rank documents", "the lazy dog " * 5, "beam"]


@pytest.fixture(scope="module")
def qwen3(random_checkpoint):
    return load_checkpoint(random_checkpoint("qwen3")[0])


def rows_seen_by_linears(model: torch.nn.Module, run) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].shape[0]))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def last_layer(name: str, model) -> bool:
    return f".layers.{model.spec.num_layers - 1}." in name


def test_score_linears_see_exactly_the_real_tokens(qwen3):
    """Every layer's linears see the real tokens, no padding; the last layer's after its q/k/v
    only each text's last token (nothing reads the others)."""
    eng = engine_for(qwen3, **SCORE)
    total = sum(len(ids) for ids in text_ids(eng, TEXTS_RANDOM))
    seen = rows_seen_by_linears(eng.graph, lambda: eng.score(TEXTS_RANDOM))
    layer_linears = {n: r for n, r in seen.items() if ".layers." in n}
    assert len(layer_linears) == 4 * qwen3.spec.num_layers  # qkv, o, gate_up, down
    for name, rows in layer_linears.items():
        tail = last_layer(name, qwen3) and not name.endswith(".qkv")
        assert rows == [len(TEXTS_RANDOM) if tail else total], (name, rows)
    assert "model.lm_head" not in seen  # only the label rows are computed, on the N last tokens


def test_beam_linears_see_the_prompt_once_then_one_row_per_beam(qwen3):
    eng = engine_for(qwen3, **BEAM)
    prompt = "a small language model"
    lp = len(text_ids(eng, [prompt])[0])
    seen = rows_seen_by_linears(eng.graph, lambda: eng.beam(prompt))
    w, steps = BEAM["beam_width"], BEAM["new_tokens"] - 1
    for name, rows in seen.items():
        if ".layers." in name:  # the last layer's prefill after q/k/v: the prompt's last token only
            first = 1 if last_layer(name, qwen3) and not name.endswith(".qkv") else lp
            assert rows == [first] + [w] * steps, (name, rows)
    assert seen["model.lm_head"] == [1] + [w] * steps


def test_prompt_kv_is_stored_once_and_never_copied_per_beam(qwen3, monkeypatch):
    prefill_k, decode_calls = [], []
    reference = slm_core.compile.model.REFERENCE_OPS

    def record_prefill(q, k, v, cu, scale, max_seqlen):
        prefill_k.append(k)
        return reference.packed_attention(q, k, v, cu, scale, max_seqlen)

    def record_decode(q, kp, vp, ks, vs, scale, cu):
        if ks.shape[1]:  # the last layer's prefill attends with no suffix (its last token's query only)
            decode_calls.append((kp, vp, ks))
        else:
            prefill_k.append(kp)
        return reference.prefix_attention(q, kp, vp, ks, vs, scale, cu)

    monkeypatch.setattr(
        slm_core.compile.model,
        "REFERENCE_OPS",
        reference._replace(packed_attention=record_prefill, prefix_attention=record_decode),
    )
    eng = engine_for(qwen3, **BEAM)
    prompt = "a small language model"
    lp = len(text_ids(eng, [prompt])[0])
    eng.beam(prompt)

    layers, w = qwen3.spec.num_layers, BEAM["beam_width"]
    assert len(prefill_k) == layers and len(decode_calls) == layers * (BEAM["new_tokens"] - 1)
    prompt_ptrs = {k.data_ptr() for k in prefill_k}
    for i, (kp, _, ks) in enumerate(decode_calls):
        step = i // layers + 1
        assert kp.shape == (lp, qwen3.spec.num_kv_heads, qwen3.spec.head_dim)  # no beam dimension
        assert kp.data_ptr() in prompt_ptrs  # the prefill's own tensor, not a copy
        assert kp.data_ptr() == prefill_k[i % layers].data_ptr()
        assert ks.shape[:2] == (w, step)  # only the suffix is per beam


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_graphs_export_with_dynamic_shapes(random_checkpoint, arch):
    ckpt = load_checkpoint(random_checkpoint(arch)[0])
    score = engine_for(ckpt, **SCORE)
    program = export_graph(score.graph, score.task).module()
    vocab = ckpt.spec.vocab_size
    torch.manual_seed(0)
    for lengths in ([1], [48], [3, 1, 17], [48] * 6):
        ids = torch.randint(0, vocab, (sum(lengths),), dtype=torch.int32)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        torch.testing.assert_close(program(ids, cu), score.graph(ids, cu), atol=1e-6, rtol=0)

    for max_batch, batches in ((1, ([1], [5], [48])), (3, ([1], [48], [5, 1, 48]))):
        beam = engine_for(ckpt, **BEAM, max_batch=max_batch)
        program = export_graph(beam.graph, beam.task).module()
        for lengths in batches:
            ids = torch.randint(0, vocab, (sum(lengths),), dtype=torch.int32)
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
            # each prompt its own width and new tokens, within the bounds
            options = torch.tensor(
                [[1 + i % beam.task.width, 1 + i % beam.task.new_tokens] for i in range(len(lengths))],
                dtype=torch.int32,
            )
            ours, eager = program(ids, cu, options), beam.graph(ids, cu, options)
            assert torch.equal(ours[0], eager[0]) and torch.equal(ours[1], eager[1])
            torch.testing.assert_close(ours[2], eager[2], atol=1e-5, rtol=0)


class _PostGrad(Exception):
    """Stops an Inductor compile once its post-grad passes ran (the test needs no code)."""


@contextlib.contextmanager
def _planned_gemms(monkeypatch):
    """Counts of the mm and addmm nodes that Inductor, deciding as for a GPU, plans for the compile
    run inside the block; that compile is stopped once its post-grad passes ran."""
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.post_grad as post_grad

    counts = {}

    def after(graph):
        for name, op in (("mm", torch.ops.aten.mm.default), ("addmm", torch.ops.aten.addmm.default)):
            counts[name] = len(graph.find_nodes(op="call_function", target=op))
        raise _PostGrad

    monkeypatch.setattr(post_grad, "is_gpu", lambda device: True)
    with inductor_config.patch(post_grad_custom_post_pass=after), pytest.raises(Exception) as stopped:
        yield counts
    assert any(isinstance(e, _PostGrad) for e in _chain(stopped.value)), stopped.value


@pytest.mark.parametrize("task", [SCORE, BEAM])
def test_residual_adds_stay_out_of_the_gemms(qwen3, task, monkeypatch):
    """In bf16 Inductor, deciding as for a GPU, leaves each residual add to the elementwise kernel after
    its GEMM (mm, then the add inside the next norm) instead of fusing it as addmm, which copies
    the residual into the GEMM's output first: an index among the consumers of the residual
    stream (the last layer's rows) would start that fusion and carry it back through every layer."""
    eng = engine_for(qwen3, **task, precision="bf16")
    program = export_graph(eng.graph, eng.task)
    with _planned_gemms(monkeypatch) as counts:
        torch._inductor.aoti_compile_and_package(program)
    assert counts["addmm"] == 0, counts
    assert counts["mm"] >= 4 * qwen3.spec.num_layers, counts  # each layer's linears, as mm


def test_the_step_bench_keeps_residual_adds_out_of_the_gemms_as_the_graphs_do(monkeypatch):
    """bench.step_bench's decode layers, compiled by Inductor deciding as for a GPU, run each
    linear as a plain GEMM (addmm only for qkv's bias), with the residual add left to the next norm,
    as the graphs run them (test_residual_adds_stay_out_of_the_gemms): otherwise the bench would
    time O and down with the residual in their epilogue, kernels the graphs never launch."""
    from bench.step_bench import step_inputs, step_layers
    from bench.workloads import QWEN25_05B
    from slm_core.spec import ModelSpec

    small = dict(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=512)
    spec = ModelSpec.from_hf_config({**QWEN25_05B, **small})
    model = slm_core.compile.model.Transformer.empty(spec, 256, torch.bfloat16, "cpu")
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    layers = torch.compile(step_layers(model), dynamic=True, fullgraph=True)
    with _planned_gemms(monkeypatch) as counts, torch.no_grad():
        layers(*step_inputs(model, 100, "cpu"))
    assert counts == {"mm": 3 * spec.num_layers, "addmm": spec.num_layers}, counts  # qkv's bias only


def test_beam_steps_sort_nothing(qwen3):
    """No step sorts: the top 2W, the running beams and the finished pool (the answer, best first)
    are taken unsorted, with their places compared, which needs no sort kernel."""
    eng = engine_for(qwen3, **BEAM)
    program = export_graph(eng.graph, eng.task)
    sorts = [
        n.args[4] if len(n.args) > 4 else n.kwargs.get("sorted", True)
        for n in program.graph.find_nodes(op="call_function", target=torch.ops.aten.topk.default)
    ]
    steps = BEAM["new_tokens"]
    assert sorts.count(True) == 0, sorts
    # per step the top 2W and the pool's merge, and the running beams but at the last step
    assert sorts.count(False) >= 3 * steps - 1, sorts


@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_top_places_are_a_stable_sort(k):
    from slm_core.compile.beam_graph import top

    g = torch.Generator().manual_seed(k)
    x = torch.randint(-4, 4, (5, 40), generator=g).float()  # many ties
    x[0, :] = float("-inf")
    x[1, ::3] = float("-inf")
    values, idx, place = top(x, k)
    assert torch.equal(x.gather(1, idx), values)
    order = torch.sort(-x, dim=1, stable=True).indices[:, :k]  # best first, ties by index
    # the same set as topk (a tie at the boundary may pick either; the places then still order it)
    assert torch.equal(values.sort(1, descending=True).values, x.topk(k, dim=1).values)
    assert torch.equal(place.sort(1).values, torch.arange(k).expand(5, k))  # a permutation of 0..k-1
    ranked = torch.empty_like(idx).scatter_(1, place, idx)
    assert torch.equal(x.gather(1, ranked), x.gather(1, order))  # best first
    for r in range(5):  # within a tie, lower indices first
        v = x[r].gather(0, ranked[r])
        same = v[1:] == v[:-1]
        assert (ranked[r][1:][same] > ranked[r][:-1][same]).all()


def test_running_beams_are_best_first_whatever_the_columns_order():
    """BeamGraph.advance lays the next step's rows out best first: the same continuations in
    another column order (a catalog's padded slots move columns) give the same rows, so a GEMM that
    rounds a row by its position rounds them alike."""
    from types import SimpleNamespace

    from slm_core.compile.beam_graph import BeamGraph, Beams, Chosen, top

    b, w, step = 2, 4, 2
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(b, 2 * w, generator=g)
    ends = torch.zeros(b, 2 * w, dtype=torch.bool)
    ends[0, scores[0].argmax()] = True  # the best of prompt 0 ends: not a running beam
    parent = torch.randint(0, w, (b, 2 * w), generator=g)
    candidates = torch.randint(0, 100, (b, 2 * w, step), generator=g)
    suffix = [(torch.randn(b * w, step - 1, 1, 2, generator=g),) * 2]
    graph = SimpleNamespace(width=w, row_topk=None)
    width = torch.tensor([[w], [3]])  # prompt 1 searches 3 wide
    out = []
    for perm in (torch.arange(2 * w), torch.randperm(2 * w, generator=g)):
        _, _, place = top(scores[:, perm], 2 * w)
        chosen = Chosen(scores[:, perm], place, parent[:, perm], candidates[:, perm], ends[:, perm], (), None)
        beams = Beams(candidates[:, :w, :-1], torch.zeros(b, w), (), suffix)
        out.append(BeamGraph.advance(graph, beams, chosen, width))
    first, second = out
    assert torch.equal(first.history, second.history) and torch.equal(first.cum, second.cum)
    assert all(torch.equal(x, y) for x, y in zip(first.suffix[0], second.suffix[0]))
    running = scores.masked_fill(ends, float("-inf")).sort(1, descending=True)
    assert torch.equal(first.cum[0], running.values[0, :w])  # best first
    assert torch.equal(first.cum[1, :3], running.values[1, :3]) and first.cum[1, 3] == float("-inf")
    assert torch.equal(first.history, candidates.gather(1, running.indices[:, :w, None].expand(-1, -1, step)))


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def test_repeated_calls_are_bit_identical(qwen3):
    score = engine_for(qwen3, **SCORE)
    assert score.score(TEXTS_RANDOM) == score.score(TEXTS_RANDOM)
    beam = engine_for(qwen3, **BEAM)
    assert beam.beam("a small language model") == beam.beam("a small language model")


def test_bf16_stays_close_to_fp32(smollm2):
    """Measured on SmolLM2: score probabilities within 0.045 of fp32 (transformers' own bf16 run is
    0.034 from its fp32 on these texts); beam: the same best candidate and >= 6 of 8 shared, their
    5-token scores within 0.26 of fp32 (0.255 on an AMD EPYC without bf16 instructions;
    transformers' own bf16 beams are 0.08-0.21 from fp32 on the H200)."""
    _, ckpt, _, _ = smollm2
    fp32 = engine_for(ckpt, task="score", prompt_template=CHAT, labels=["Yes", "No"], max_texts=8)
    bf16 = engine_for(ckpt, task="score", prompt_template=CHAT, labels=["Yes", "No"], max_texts=8, precision="bf16")
    assert next(bf16.graph.parameters()).dtype == torch.bfloat16
    for row32, row16 in zip(fp32.score(TEXTS), bf16.score(TEXTS)):
        assert row16 == pytest.approx(row32, abs=0.06)

    beam = dict(
        task="beam", prompt_template=CHAT.replace("{text}", "{prompt}"), beam_width=8, new_tokens=5, stop=["<|im_end|>"]
    )
    a = engine_for(ckpt, **beam).beam("What is the capital of France?")
    b = engine_for(ckpt, **beam, precision="bf16").beam("What is the capital of France?")
    assert a[0]["token_ids"] == b[0]["token_ids"]
    shared = {tuple(c["token_ids"]) for c in a} & {tuple(c["token_ids"]) for c in b}
    assert len(shared) >= 6
    scores_a = {tuple(c["token_ids"]): c["score"] for c in a}
    for c in b:
        if tuple(c["token_ids"]) in shared:
            assert c["score"] == pytest.approx(scores_a[tuple(c["token_ids"])], abs=0.35)
