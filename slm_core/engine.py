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
        cap = task.max_texts * task.max_text_tokens if task.task == "score" else task.max_prompt_tokens
        self._ids = torch.empty(cap, dtype=torch.int32, pin_memory=pin)  # packed token ids
        self._cu = torch.empty(task.max_texts + 1, dtype=torch.int32, pin_memory=pin)  # cu_seqlens
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
        self._expect("score")
        with self._lock, torch.inference_mode():
            n, t = self.tokenizer.pack_texts(texts, self._ids.numpy(), self._cu.numpy())
            start = time.perf_counter()
            ids = self._ids[:t].to(self.device, non_blocking=True)
            cu = self._cu[: n + 1].to(self.device, non_blocking=True)
            rows = self.graph(ids, cu).cpu().tolist()
            return rows, CallStats(texts=n, tokens=t, graph_ms=(time.perf_counter() - start) * 1e3)

    def run_beam(self, prompt: object) -> tuple[list[dict[str, Any]], "CallStats"]:
        self._expect("beam")
        with self._lock, torch.inference_mode():
            n = self.tokenizer.pack_prompt(prompt, self._ids.numpy())
            start = time.perf_counter()
            tokens, lengths, scores = self.graph(self._ids[:n].to(self.device, non_blocking=True))
            tokens, lengths, scores = tokens.cpu().tolist(), lengths.cpu().tolist(), scores.cpu().tolist()
            stats = CallStats(texts=1, tokens=n, graph_ms=(time.perf_counter() - start) * 1e3)
        out = []
        for ids, length, score in zip(tokens, lengths, scores):
            ids = ids[:length]
            out.append({"text": self.tokenizer.decode(ids), "token_ids": ids, "score": score})
        return out, stats

    def _expect(self, kind: str) -> None:
        if self.task.task != kind:
            raise TypeError(f"this engine runs a {self.task.task!r} task, not {kind!r}")


@dataclass(frozen=True)
class CallStats:
    """What one request cost: texts and prompt tokens in, milliseconds from copy-in to results on host."""

    texts: int
    tokens: int
    graph_ms: float
