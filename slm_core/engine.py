"""Engine: the Python API of DESIGN.md over one request graph, eager (nn.Module) or compiled
(an AOTInductor package with the same signature, see slm_core.package).

    eng = Engine.from_checkpoint("ckpt-dir-or.gguf", task="task.yaml", device="cpu")
    eng.score(["text a", "text b"])  # [[p_label0, p_label1, ...], ...]
    eng.beam("a prompt")             # [{"text", "token_ids", "score"}, ...] best first
"""

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from slm_core.checkpoint import Checkpoint, load_checkpoint
from slm_core.errors import InputError
from slm_core.graphs import BeamGraph, ScoreGraph
from slm_core.model import Transformer
from slm_core.spec import PRECISIONS, RuntimeSpec, TaskSpec
from slm_core.tokenizer import PackedTokenizer


def build_graph(ckpt: Checkpoint, task: TaskSpec, runtime: RuntimeSpec) -> tuple[torch.nn.Module, PackedTokenizer]:
    """Checkpoint + task -> (ScoreGraph | BeamGraph on the runtime device, packed tokenizer)."""
    tokenizer = PackedTokenizer(ckpt.tokenizer, task)
    dtype = getattr(torch, PRECISIONS[task.precision])
    model = Transformer.empty(ckpt.spec, task.max_seq_tokens, dtype, runtime.device, runtime.attention)
    model.load_hf_weights(ckpt.weights)
    if task.task == "score":
        graph = ScoreGraph(model, tokenizer.label_ids())
    else:
        stop = tokenizer.stop_ids()
        graph = BeamGraph(model, task.beam_width, task.new_tokens, stop, pad_id=stop[0] if stop else 0)
    return graph.to(runtime.device).eval(), tokenizer


class Engine:
    """Runs one task's graph. Buffers for one request are preallocated to the task bounds; calls are
    serialised by a lock (the request-context pool for concurrent calls belongs to the runtime)."""

    def __init__(self, graph: torch.nn.Module, tokenizer: PackedTokenizer, task: TaskSpec, runtime: RuntimeSpec):
        self.graph = graph
        self.tokenizer = tokenizer
        self.task = task
        self.device = torch.device(runtime.device)
        pin = self.device.type == "cuda"
        self._ids = torch.empty(task.call_tokens, dtype=torch.int32, pin_memory=pin)  # packed token ids
        self._cu = torch.empty(task.call_texts + 1, dtype=torch.int32, pin_memory=pin)  # cu_seqlens
        self._lock = threading.Lock()

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, task: "str | Path | Mapping[str, Any] | TaskSpec", device: str = "cpu"
    ) -> "Engine":
        task, runtime = TaskSpec.load(task), RuntimeSpec(device=device)
        graph, tokenizer = build_graph(load_checkpoint(path), task, runtime)
        return cls(graph, tokenizer, task, runtime)

    def score(self, texts: list[str]) -> list[list[float]]:
        """One probability row per text over the task's labels, in the labels' order."""
        return self.run_score(texts)[0]

    def beam(self, prompt: str) -> list[dict[str, Any]]:
        """All W candidates, best first: text, token ids (the stop token included), cumulative log-prob."""
        return self.run_beam(prompt)[0]

    def run_score(self, texts: object) -> tuple[list[list[float]], "CallStats"]:
        (result,) = self.run_score_batch([texts])
        if isinstance(result, InputError):
            raise result
        return result

    def run_score_batch(self, requests: list[object]) -> list["tuple[list[list[float]], CallStats] | InputError"]:
        """Up to max_batch score requests (each a list of texts) in one graph call: their texts are
        packed one after another, as if one request. Per request, in order: (rows, stats) or the
        InputError that kept it out of the call; the others are unaffected."""
        self._expect("score")
        if len(requests) > self.task.max_batch:
            raise ValueError(f"{len(requests)} requests exceed max_batch={self.task.max_batch}")
        ids_np, cu_np = self._ids.numpy(), self._cu.numpy()
        results: list = []
        with self._lock, torch.inference_mode():
            n = t = 0
            spans = []  # (first text, texts, tokens) of each packed request
            for texts in requests:
                try:
                    ni, ti = self.tokenizer.pack_texts(texts, ids_np[t:], cu_np[n:])
                except InputError as e:
                    results.append(e)
                    continue
                cu_np[n : n + ni + 1] += t  # its boundaries, shifted behind the requests before it
                spans.append((n, ni, ti))
                results.append(None)
                n, t = n + ni, t + ti
            if not spans:
                return results
            start = time.perf_counter()
            ids = self._ids[:t].to(self.device, non_blocking=True)
            cu = self._cu[: n + 1].to(self.device, non_blocking=True)
            rows = self.graph(ids, cu).cpu().tolist()
            graph_ms = (time.perf_counter() - start) * 1e3
        it = iter(spans)
        for i, result in enumerate(results):
            if result is None:
                first, ni, ti = next(it)
                results[i] = rows[first : first + ni], CallStats(ni, ti, graph_ms, batch=len(spans))
        return results

    def run_beam(self, prompt: object) -> tuple[list[dict[str, Any]], "CallStats"]:
        (result,) = self.run_beam_batch([prompt])
        if isinstance(result, InputError):
            raise result
        return result

    def run_beam_batch(self, prompts: list[object]) -> list["tuple[list[dict[str, Any]], CallStats] | InputError"]:
        """Up to max_batch beam prompts in one graph call. Per prompt, in order: (candidates best
        first, stats) or the InputError that kept it out of the call; the others are unaffected."""
        self._expect("beam")
        if len(prompts) > self.task.max_batch:
            raise ValueError(f"{len(prompts)} requests exceed max_batch={self.task.max_batch}")
        ids_np, cu_np = self._ids.numpy(), self._cu.numpy()
        results: list = []
        with self._lock, torch.inference_mode():
            cu_np[0] = t = 0
            lengths = []
            for prompt in prompts:
                try:
                    n = self.tokenizer.pack_prompt(prompt, ids_np[t:])
                except InputError as e:
                    results.append(e)
                    continue
                t += n
                lengths.append(n)
                cu_np[len(lengths)] = t
                results.append(None)
            if not lengths:
                return results
            start = time.perf_counter()
            ids = self._ids[:t].to(self.device, non_blocking=True)
            cu = self._cu[: len(lengths) + 1].to(self.device, non_blocking=True)
            tokens, ends, scores = (x.cpu().tolist() for x in self.graph(ids, cu))
            graph_ms = (time.perf_counter() - start) * 1e3
        answers = iter(zip(lengths, tokens, ends, scores))
        for i, result in enumerate(results):
            if result is None:
                n, rows, row_ends, row_scores = next(answers)
                candidates = [{"text": self.tokenizer.decode(ids[:end]), "token_ids": ids[:end], "score": score}
                              for ids, end, score in zip(rows, row_ends, row_scores)]
                results[i] = candidates, CallStats(1, n, graph_ms, batch=len(lengths))
        return results

    def _expect(self, kind: str) -> None:
        if self.task.task != kind:
            raise TypeError(f"this engine runs a {self.task.task!r} task, not {kind!r}")


@dataclass(frozen=True)
class CallStats:
    """What one request cost: texts and prompt tokens in, milliseconds from copy-in to results on
    host of the graph call that served it, and how many requests that call served."""

    texts: int
    tokens: int
    graph_ms: float
    batch: int = 1
