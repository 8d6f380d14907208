"""The runtime: one task's request path, encode -> compiled graph -> decode, in a request context
preallocated at load.

    results = engine.run([value, ...])   # up to max_batch request values, one graph call
    answer = engine.run_one(value)       # one request; its InputError raised
    engine.swap(task.with_data(path, version))   # another version of the task's data, from the next call

A task is immutable: a swap replaces it between two calls, and a call runs, and answers, wholly
with one task.
"""

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slm_core.errors import InputError
from slm_core.serve.replay import even_split
from slm_core.tasks import Task


@dataclass(frozen=True)
class CallStats:
    """What a request cost: its sequences and tokens, the milliseconds of the graph call that
    served it (copy-in to results on the host), how many requests that call served, and the
    call's number in this engine (requests that shared a call share it)."""

    texts: int
    tokens: int
    graph_ms: float
    batch: int = 1
    call: int = 0
    data_version: str = ""  # the version of the task's data that answered (Task.data_version)


@dataclass(frozen=True)
class Result:
    """One request's outcome: its answer and what it cost, or the InputError that refused it."""

    answer: Any = None
    stats: CallStats | None = None
    error: InputError | None = None


@dataclass(frozen=True)
class Span:
    """Where a request's sequences sit in a packed call."""

    first: int
    count: int
    tokens: int


class Context:
    """A graph call's state, preallocated at load: the packed token ids, cu_seqlens and the
    sequences' options rows in host memory (pinned on CUDA), the CUDA graphs that replay calls
    from them (slm_core.serve.replay; None runs the graph as it is) and, on CUDA, the stream the
    calls run on. A call holds it from packing its inputs to reading its outputs back."""

    def __init__(self, task: Task, device: torch.device, replay=None):
        pin = device.type == "cuda"
        self.ids = torch.empty(task.graph_tokens, dtype=torch.int32, pin_memory=pin)  # packed token ids
        self.cu = torch.empty(task.graph_texts + 1, dtype=torch.int32, pin_memory=pin)  # cu_seqlens
        # each sequence's options (Task.options), or None where the graph takes none
        self.options = (
            torch.empty(task.graph_texts, task.option_columns, dtype=torch.int32, pin_memory=pin)
            if task.option_columns
            else None
        )
        self.replay = replay
        self.stream = torch.cuda.Stream(device) if pin else None


class Runtime:
    """Runs one task's graph, eager (an nn.Module) or compiled (an AOTInductor package with the
    same signature). Calls take the engine's request context in turn. `headroom`: room in the
    graph constants' buffers for data swapped in later (swap), as a share of each size."""

    def __init__(self, graph: Callable, task: Task, device: "torch.device | str", replay=None, headroom: float = 0.0):
        self.graph = graph
        self.task = task
        self.device = torch.device(device)
        # after the call's inputs; `headroom` (a share of each size) lets later data be swapped in place
        self.headroom = headroom
        self.constants = tuple(c.to(self.device) for c in task.graph_constants(self._capacity(task)))
        self.context = Context(task, self.device, replay)
        self._lock = threading.Lock()
        self._calls = itertools.count(1)

    @property
    def tokenizer(self):
        return self.task.tokenizer

    def run_one(self, value: Any) -> Any:
        """One request value's answer, in a call of its own; InputError when it is refused."""
        (result,) = self.run([value])
        if result.error is not None:
            raise result.error
        return result.answer

    def run(self, values: list[Any], encoded: list | None = None) -> list[Result]:
        """Up to max_batch request values in one graph call, packed one after another. Per value,
        in order, its Result; a refused one does not hold back the others. `encoded`: the values
        as Task.encode gives them, where the caller has them already."""
        task = self.task
        if len(values) > task.max_batch:
            raise ValueError(f"{len(values)} requests exceed max_batch={task.max_batch}")
        encoded = task.encode(values) if encoded is None else encoded
        rows = self._rows(task, values, encoded)  # before the lock: a catalog's exclusion is CPU work
        with self._lock:
            if self.task is not task:  # swapped meanwhile: the call runs, and answers, with the new one
                task = self.task
                encoded = task.encode(values)
                rows = self._rows(task, values, encoded)
            spans = self._pack(encoded, rows)
            members = [s for s in spans if isinstance(s, Span)]
            if not members:
                return [Result(error=s) for s in spans]
            n, t = sum(s.count for s in members), sum(s.tokens for s in members)
            outputs, graph_ms = self._call(n, t)
            call = next(self._calls)
        return [
            Result(error=s)
            if isinstance(s, InputError)
            else Result(
                task.unpack(outputs, s.first, s.count, value),
                CallStats(s.count, s.tokens, graph_ms, len(members), call, task.data_version),
            )
            for s, value in zip(spans, values)
        ]

    def swap(self, task: Task) -> bool:
        """Serve `task` (this one's task over another version of its data: Task.with_data) from the
        next call on. Its graph constants are copied into the device buffers the calls, and their
        CUDA graphs, read; data that does not fit them gets new buffers, and the CUDA graphs are
        dropped (each bucket is captured again at its next call). Returns whether it fit."""
        constants = task.graph_constants([len(c) for c in self.constants])  # padded to the buffers
        fits = constants is not None
        if not fits:
            constants = task.graph_constants(self._capacity(task))
        ctx = self.context
        pin = self.device.type == "cuda"
        staged = [c.pin_memory() if pin else c for c in constants]  # before the lock: host work
        with self._lock:
            if fits:
                with torch.cuda.stream(ctx.stream) if ctx.stream else contextlib.nullcontext():
                    for buffer, c in zip(self.constants, staged):
                        buffer.copy_(c, non_blocking=pin)
                if ctx.stream is not None:  # the host copies stay alive until they are read
                    ctx.stream.synchronize()
            else:
                self.constants = tuple(c.to(self.device) for c in staged)
                if ctx.replay is not None:
                    ctx.replay.drop(self.constants)
            self.task = task
        return fits

    def usable(self) -> bool:
        """Whether the device still runs work: after a failed call, tells a failure of that call
        (a bug, an out-of-memory) from a context that fails every call from now on (DeviceLost)."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except RuntimeError:  # torch.AcceleratorError is one
            return False

    def _capacity(self, task: Task) -> list[int] | None:
        """The first dimensions of the graph constants' buffers for `task`: without headroom, its
        data's own."""
        return task.constant_capacity(self.headroom) if self.headroom else None

    @staticmethod
    def _rows(task: Task, values: list, encoded: list) -> list:
        """Each value's options row (Task.options), None for a refused one or a graph without options."""
        return [
            None if isinstance(e, InputError) or not task.option_columns else task.options(v)
            for v, e in zip(values, encoded)
        ]

    def synthetic_call(self, sequences: int, tokens: int) -> float:
        """A call of `sequences` sequences of about equal length holding `tokens` token ids 1, as
        the build times calls at the task's bounds; returns its milliseconds."""
        with self._lock:
            row = self.task.options(self.task.request_of(["x"]))  # the task's bounds
            self._pack([[[1] * n for n in even_split(tokens, sequences)]], [row])
            return self._call(sequences, tokens)[1]

    def _pack(self, encoded: list, rows: list) -> "list[Span | InputError]":
        """Each request's sequences behind the ones before it, each with its request's options row
        (Task.options; unused where the graph takes none), into the context's host buffers."""
        ids, cu = self.context.ids.numpy(), self.context.cu.numpy()
        options = self.context.options.numpy() if self.context.options is not None else None
        spans: list = []
        n = t = 0
        cu[0] = 0
        for request, row in zip(encoded, rows):
            if isinstance(request, InputError):
                spans.append(request)
                continue
            start_n, start_t = n, t
            if options is not None:
                options[n : n + len(request)] = row
            for seq in request:
                ids[t : t + len(seq)] = seq
                t += len(seq)
                n += 1
                cu[n] = t
            spans.append(Span(start_n, n - start_n, t - start_t))
        return spans

    def _call(self, n: int, t: int) -> tuple[list, float]:
        """The graph over the packed call of n sequences, t tokens: its outputs on the host (as
        Task.host makes them) and the milliseconds from copy-in to results on the host."""
        ctx = self.context
        start = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(ctx.stream) if ctx.stream else contextlib.nullcontext():
            out = ctx.replay(ctx.ids, ctx.cu, ctx.options, n, t) if ctx.replay is not None else None
            if out is None:
                inputs = [ctx.ids[:t], ctx.cu[: n + 1]] + ([] if ctx.options is None else [ctx.options[:n]])
                out = self.graph(*(x.to(self.device, non_blocking=True) for x in inputs), *self.constants)
            outputs = [self.task.host(x.cpu()) for x in ((out,) if isinstance(out, torch.Tensor) else out)]
        return outputs, (time.perf_counter() - start) * 1e3
