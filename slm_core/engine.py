"""Engine: the Python API of DESIGN.md over one request graph, eager (nn.Module) or compiled
(an AOTInductor package with the same signature, see slm_core.package).

    eng = Engine.from_checkpoint("ckpt-dir-or.gguf", task="task.yaml", device="cpu")
    eng.score(["text a", "text b"])  # [[p_label0, p_label1, ...], ...]
    eng.beam("a prompt")             # [{"text", "token_ids", "score"}, ...] best first
"""

import contextlib
import queue
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from slm_core.checkpoint import Checkpoint, classifier_head, load_checkpoint
from slm_core.errors import InputError
from slm_core.fp8 import CALIBRATION_TEXTS, STATIC, calibrate, quantize_linears
from slm_core.graphs import BeamGraph, ScoreGraph
from slm_core.model import Transformer
from slm_core.spec import PRECISIONS, RuntimeSpec, TaskSpec
from slm_core.tokenizer import PackedTokenizer


def resolve_task(ckpt: Checkpoint, task: TaskSpec) -> TaskSpec:
    """The task as it serves this checkpoint: a classifier's label names filled in (id2label)."""
    if task.task == "score" and task.head == "classifier":
        return replace(task, labels=classifier_head(ckpt, task.labels)[2])
    return task


def build_graph(ckpt: Checkpoint, task: TaskSpec, runtime: RuntimeSpec) -> tuple[torch.nn.Module, PackedTokenizer]:
    """Checkpoint + task -> (ScoreGraph | BeamGraph on the runtime device, packed tokenizer). A
    classifier's label names are checked here; resolve_task fills them into the task the Engine serves."""
    tokenizer = PackedTokenizer(ckpt.tokenizer, task)
    dtype = getattr(torch, PRECISIONS[task.precision])
    model = Transformer.empty(ckpt.spec, task.max_seq_tokens, dtype, runtime.device, runtime.attention)
    classifier = task.task == "score" and task.head == "classifier"
    model.load_hf_weights(ckpt.weights, lm_head=not classifier)
    logits = task.output == "logits"
    if classifier:
        weight, bias, _ = classifier_head(ckpt, task.labels)
        graph = ScoreGraph.classifier(model, weight, bias, logits)
    elif task.task == "score":
        graph = ScoreGraph.labels(model, tokenizer.label_ids(), logits)  # copies its label rows of the LM head first
    else:
        stop = tokenizer.stop_ids()
        topk = None
        if runtime.topk == "triton":
            from kernels.vocab_topk import vocab_topk as topk
        graph = BeamGraph(model, task.beam_width, task.new_tokens, stop, pad_id=stop[0] if stop else 0, topk=topk)
    graph = graph.to(runtime.device).eval()
    amax = _calibrate(model, graph, tokenizer, task, runtime) if task.precision in STATIC else None
    quantize_linears(model, task.precision, runtime.attention == "triton", amax)  # fp8: E4M3 modules in place of bf16
    return graph, tokenizer


def _calibrate(model: Transformer, graph: torch.nn.Module, tokenizer: PackedTokenizer, task: TaskSpec,
               runtime: RuntimeSpec) -> dict:
    """fp8-static's calibration (slm_core.fp8.calibrate): the graph, still in bf16, run eagerly on
    each of CALIBRATION_TEXTS as a request of one text or one prompt; those past the task's bounds
    are skipped."""
    engine = Engine(graph, tokenizer, task, runtime)
    if task.task == "score":
        return calibrate(model, lambda: [engine.run_score_batch([[text]]) for text in CALIBRATION_TEXTS])
    return calibrate(model, lambda: [engine.run_beam_batch([text]) for text in CALIBRATION_TEXTS])


class Context:
    """One graph call's own state, preallocated at load (DESIGN.md's request context): the packed
    token ids and cu_seqlens in host memory (pinned on CUDA), the CUDA graphs that replay calls
    from them (slm_core.replay.CudaGraphs: own static inputs, own memory pool; None runs the
    graph as is) and, on CUDA, the stream its calls run on. A call holds one context from
    packing its inputs to reading its outputs back."""

    def __init__(self, task: TaskSpec, device: torch.device, replay=None):
        pin = device.type == "cuda"
        self.ids = torch.empty(task.graph_tokens, dtype=torch.int32, pin_memory=pin)  # packed token ids
        self.cu = torch.empty(task.graph_texts + 1, dtype=torch.int32, pin_memory=pin)  # cu_seqlens
        self.replay = replay
        self.stream = torch.cuda.Stream(device) if pin else None


class Engine:
    """Runs one task's graph. Each call takes a free request context (Context) and holds it to the
    end, so as many calls run at once as there are contexts (one per entry of `replays`), each on
    its own CUDA stream; more wait for one. `graph` must accept calls from several threads at once
    when there are several contexts (slm_core.package serialises an AOTInductor runner's)."""

    def __init__(self, graph: torch.nn.Module, tokenizer: PackedTokenizer, task: TaskSpec, runtime: RuntimeSpec,
                 replays: Sequence = (None,)):
        self.graph = graph
        self.tokenizer = tokenizer
        self.task = task
        self.device = torch.device(runtime.device)
        self.contexts = [Context(task, self.device, replay) for replay in replays]
        self._free: queue.SimpleQueue[Context] = queue.SimpleQueue()
        for context in self.contexts:
            self._free.put(context)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, task: "str | Path | Mapping[str, Any] | TaskSpec", device: str = "cpu"
    ) -> "Engine":
        ckpt, runtime = load_checkpoint(path), RuntimeSpec(device=device)
        task = resolve_task(ckpt, TaskSpec.load(task))
        graph, tokenizer = build_graph(ckpt, task, runtime)
        return cls(graph, tokenizer, task, runtime)

    def score(self, texts: list[str]) -> list[list[float]]:
        """One row per text over the task's labels, in the labels' order: probabilities (or the
        logits, task output: logits)."""
        return self.run_score(texts)[0]

    def beam(self, prompt: str) -> list[dict[str, Any]]:
        """All W candidates, best first: text, token ids (the stop token included), cumulative log-prob."""
        return self.run_beam(prompt)[0]

    def run_score(self, texts: object) -> tuple[list[list[float]], "CallStats"]:
        return _only(self.run_score_batch([texts]))

    def run_score_batch(self, requests: list[object]) -> list["tuple[list[list[float]], CallStats] | InputError"]:
        """Up to max_batch score requests (each a list of texts) in one graph call: their texts are
        packed one after another, as if one request. Per request, in order: (rows, stats) or the
        InputError that kept it out of the call; the others are unaffected."""
        self._expect("score")
        spans, outputs, graph_ms, captured = self._call(requests, self.tokenizer.pack_texts)
        batch = sum(not isinstance(s, InputError) for s in spans)
        return [s if isinstance(s, InputError) else
                (outputs[0][s[0] : s[0] + s[1]], CallStats(s[1], s[2], graph_ms, batch, captured)) for s in spans]

    def run_beam(self, prompt: object) -> tuple[list[dict[str, Any]], "CallStats"]:
        return _only(self.run_beam_batch([prompt]))

    def run_beam_batch(self, prompts: list[object]) -> list["tuple[list[dict[str, Any]], CallStats] | InputError"]:
        """Up to max_batch beam prompts in one graph call. Per prompt, in order: (candidates best
        first, stats) or the InputError that kept it out of the call; the others are unaffected."""
        self._expect("beam")

        def pack(ids, ids_out, cu_out):  # one prompt is one sequence
            if isinstance(ids, InputError):
                raise ids
            ids_out[: len(ids)] = ids
            cu_out[0], cu_out[1] = 0, len(ids)
            return 1, len(ids)

        spans, outputs, graph_ms, captured = self._call(self.tokenizer.encode_prompts(prompts), pack)
        batch = sum(not isinstance(s, InputError) for s in spans)
        results = []
        for span in spans:
            if isinstance(span, InputError):
                results.append(span)
                continue
            rows, ends, scores = (out[span[0]] for out in outputs)  # [W][new_tokens], [W], [W]
            ids = [row[:end] for row, end in zip(rows, ends)]
            candidates = [{"text": text, "token_ids": i, "score": score}
                          for text, i, score in zip(self.tokenizer.decode_each(ids), ids, scores)]
            results.append((candidates, CallStats(1, span[2], graph_ms, batch, captured)))
        return results

    def each_context(self):
        """Each request context in turn as the only free one, for calls made at load (capturing
        CUDA graphs): a call in the loop body runs in the context yielded. Waits for calls in flight."""
        held = [self._free.get() for _ in self.contexts]
        try:
            for ctx in held:
                self._free.put(ctx)
                try:
                    yield ctx
                finally:
                    self._free.get()
        finally:
            for ctx in held:
                self._free.put(ctx)

    def _call(self, requests: list[object], pack) -> tuple[list, list, float, bool]:
        """Pack each request behind the ones before it and run the graph once for all of them.
        pack(request, ids_out, cu_out) writes one request's ids and its own boundaries (from 0)
        and returns (sequences, tokens), or raises InputError having written nothing. Returns per
        request its InputError or its span (first sequence, sequences, tokens); the graph's
        outputs as host lists; the call's milliseconds from copy-in to results on the host; whether
        the call captured a new CUDA graph (its first call of a size bucket, about three calls' time).
        It runs in the next free context."""
        if len(requests) > self.task.max_batch:
            raise ValueError(f"{len(requests)} requests exceed max_batch={self.task.max_batch}")
        ctx = self._free.get()
        try:
            with torch.inference_mode(), (torch.cuda.stream(ctx.stream) if ctx.stream else contextlib.nullcontext()):
                return self._run(ctx, requests, pack)
        finally:
            self._free.put(ctx)

    def _run(self, ctx: Context, requests: list[object], pack) -> tuple[list, list, float, bool]:
        ids_np, cu_np = ctx.ids.numpy(), ctx.cu.numpy()
        spans: list = []
        n = t = 0
        for request in requests:
            try:
                ni, ti = pack(request, ids_np[t:], cu_np[n:])
            except InputError as e:
                spans.append(e)
                continue
            cu_np[n : n + ni + 1] += t  # its boundaries, shifted behind the requests before it
            spans.append((n, ni, ti))
            n, t = n + ni, t + ti
        if n == 0:
            return spans, [], 0.0, False
        start = time.perf_counter()
        replay = ctx.replay
        captured_before = len(replay.graphs) if replay is not None else 0  # one per bucket captured so far
        out = replay(ctx.ids, ctx.cu, n, t) if replay is not None else None
        if out is None:
            out = self.graph(ctx.ids[:t].to(self.device, non_blocking=True),
                             ctx.cu[: n + 1].to(self.device, non_blocking=True))
        outputs = [x.cpu().tolist() for x in ((out,) if isinstance(out, torch.Tensor) else out)]
        captured = replay is not None and len(replay.graphs) > captured_before
        return spans, outputs, (time.perf_counter() - start) * 1e3, captured

    def _expect(self, kind: str) -> None:
        if self.task.task != kind:
            raise TypeError(f"this engine runs a {self.task.task!r} task, not {kind!r}")


def _only(results: list) -> Any:
    """The one result of a batch of one, raising its InputError."""
    (result,) = results
    if isinstance(result, InputError):
        raise result
    return result


@dataclass(frozen=True)
class CallStats:
    """What one request cost: texts and prompt tokens in, milliseconds from copy-in to results on
    host of the graph call that served it, and how many requests that call served."""

    texts: int
    tokens: int
    graph_ms: float
    batch: int = 1
    captured: bool = False  # the call captured a CUDA graph (slm_core.replay) before replaying it
