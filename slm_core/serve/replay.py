"""CUDA-graph replay of a compiled request graph, one captured graph per input-size bucket.

A call packs N sequences of T tokens; CUDA graphs need fixed shapes. So a call is padded up to a
bucket, T to within 1/16 of itself:
- tasks that pad with sequences (Task.pad_sequences: score): N to the next power of two (at least
  N + 1, at most call_texts + 1, more when the padding tokens need more sequences), by appending
  padding sequences, each at least one token and at most the per-sequence bound, so positions
  stay inside RoPE's table;
- the others (beam: a padding prompt would cost W beams at every step): N stays, and the padding
  tokens form a tail behind the last sequence that belongs to none: the attention kernels never
  visit it and nothing reads its rows (its RoPE positions are clamped to the table).
Sequences do not see each other, so the real rows' answers do not change. The compiled graph
accepts these sizes (Task.graph_tokens, graph_texts).

A bucket is captured the first time a call lands in it, from that call's own inputs: one run
outside the capture, the capture, and a replay that answers the call. So a worker is ready once
its package is loaded, and captures only the buckets its traffic uses (a beam task's bounds span
hundreds of buckets; W2's prompts land in a fraction of them). A served call then copies its
inputs into the static buffers and replays one graph launch instead of ~1,500 kernel launches.
The graphs share one memory pool: a context runs one call at a time and reads its outputs before
the next, and a capture happens inside a call. bucket_grid lists one call per bucket that a call
within the task's bounds lands in.
"""

import logging

import torch

from slm_core.tasks import Task

log = logging.getLogger(__name__)
PAD_TOKEN = 0


def even_split(total: int, parts: int) -> list[int]:
    """`total` as `parts` lengths that differ by at most one, the longer first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def bucket(task: Task, sequences: int, tokens: int) -> tuple[int, int, list[int]] | None:
    """(bucket sequences, bucket tokens, lengths of the padding sequences) for a call of
    `sequences` sequences and `tokens` tokens, or None when no bucket can hold it. Padding tokens
    beyond the padding sequences are the unowned tail."""
    if not task.pad_sequences:
        padded_t = _round_tokens(tokens)
        return (sequences, padded_t, []) if padded_t <= task.graph_tokens else None
    longest = task.sequence_tokens
    extra = min(1 << sequences.bit_length(), task.call_texts + 1) - sequences  # to a power of two > sequences
    padded_t = _round_tokens(tokens + extra)
    pad = padded_t - tokens
    extra = max(extra, -(-pad // longest))  # as many padding sequences as the padding tokens need
    if extra < 1 or sequences + extra > task.graph_texts or padded_t > task.graph_tokens:
        return None
    lengths = even_split(pad, extra)
    return sequences + extra, padded_t, lengths


def bucket_grid(task: Task) -> list[tuple[int, int]]:
    """One call (sequences, tokens) per bucket that a call within the task's bounds lands in: 1 to
    call_texts sequences of 1 to sequence_tokens tokens each. A bucket's calls are a run of
    consecutive token counts (bucket tokens never fall as tokens grow, and for the same bucket
    tokens the padding sequences never grow), so each run's end is found by bisection."""
    calls: dict[tuple[int, int], tuple[int, int]] = {}
    for n in range(1, task.call_texts + 1):
        t, last = n, n * task.sequence_tokens
        while t <= last:
            b = bucket(task, n, t)
            if b is None:  # too many padding sequences at this size; a few more tokens may fit
                t += 1
                continue
            calls.setdefault(b[:2], (n, t))
            lo, hi = t, last
            while lo < hi:
                mid = (lo + hi + 1) // 2
                m = bucket(task, n, mid)
                lo, hi = (mid, hi) if m is not None and m[:2] == b[:2] else (lo, mid - 1)
            t = lo + 1
    return list(calls.values())


def _round_tokens(t: int) -> int:
    """Up to a multiple of 32, or of the power of two 1/16 below t: at most 6.25 % padding."""
    step = max(32, 1 << max(0, t.bit_length() - 5))
    return -(-t // step) * step


def pad_inputs(
    ids: torch.Tensor, cu: torch.Tensor, sequences: int, tokens: int, bucketed: tuple[int, int, list[int]]
) -> tuple[int, int]:
    """Pad the packed call in the host buffers ids/cu (sized to the task's graph bounds) to its
    bucket: padding sequences of the bucket's lengths behind it, then the tail; returns the padded
    (sequences, tokens). A task's options rows need no padding: the tasks that pad with
    sequences take no options (CudaGraphs checks)."""
    padded_n, padded_t, lengths = bucketed
    if lengths:
        cu[sequences + 1 : padded_n + 1] = torch.tensor(lengths, dtype=cu.dtype).cumsum(0) + tokens
    ids[tokens:padded_t] = PAD_TOKEN
    return padded_n, padded_t


class CudaGraphs:
    """Replays `graph` (an AOTInductor package loaded with run_single_threaded=True) from CUDA
    graphs on `stream` (the request context's), one per bucket, each captured at its bucket's
    first call; a call of another size runs the graph as it is."""

    def __init__(
        self,
        graph,
        task: Task,
        device: torch.device,
        constants: tuple[torch.Tensor, ...] = (),
        stream: "torch.cuda.Stream | None" = None,
    ):
        if task.pad_sequences and task.option_columns:
            raise ValueError(
                f"{type(task).__name__} pads calls with sequences and takes options: a padding "
                "sequence would need an options row"
            )
        self.graph = graph
        self.task = task
        self.device = device
        self.stream = stream
        self.ids = torch.zeros(task.graph_tokens, dtype=torch.int32, device=device)  # static inputs
        self.cu = torch.zeros(task.graph_texts + 1, dtype=torch.int32, device=device)
        self.options = (
            torch.zeros(task.graph_texts, task.option_columns, dtype=torch.int32, device=device)
            if task.option_columns
            else None
        )
        self.constants = constants  # the engine's device tensors: the same for every call
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None
        self.failed = False  # a capture failed: every call runs the graph as it is

    def __call__(self, ids: torch.Tensor, cu: torch.Tensor, options: torch.Tensor | None, sequences: int, tokens: int):
        """The graph's outputs (device tensors, valid until the next call) for the packed call in
        the pinned host buffers ids[:tokens], cu[:sequences + 1], options[:sequences], or None when
        it does not replay. A call in a bucket not captured yet captures it, and is answered by
        the new graph's first replay."""
        if self.failed or (b := bucket(self.task, sequences, tokens)) is None:
            return None
        n, t = pad_inputs(ids, cu, sequences, tokens, b)
        self.ids[:t].copy_(ids[:t], non_blocking=True)
        self.cu[: n + 1].copy_(cu[: n + 1], non_blocking=True)
        if options is not None:
            self.options[:n].copy_(options[:n], non_blocking=True)
        if b[:2] not in self.graphs:
            return self._first_call(b[:2], n, t)
        graph, outputs = self.graphs[b[:2]]
        graph.replay()
        return outputs

    def drop(self, constants: tuple[torch.Tensor, ...]) -> None:
        """Forget every graph: the calls read `constants` (a task's new data, in new buffers) from now
        on, and capture their buckets again. The old graphs' memory in the pool is reused."""
        self.graphs.clear()
        self.constants = constants

    def _first_call(self, key: tuple[int, int], n: int, t: int):
        """Capture the bucket `key` from the call of n sequences, t tokens in the static inputs, and
        answer the call by the new graph's first replay. The call runs once outside the capture
        first (lazy initialisation; an error there is the call's own). PyTorch keeps a cuBLAS
        workspace per (handle, stream) and a graph bakes in the one of the stream it was captured
        on: that first run allocates the stream's own, outside the pool. If the capture fails
        (something in the graph cannot be captured), calls run without CUDA graphs from now on
        (None: the caller runs the graph as it is)."""
        args = (self.ids[:t], self.cu[: n + 1], *([] if self.options is None else [self.options[:n]]), *self.constants)
        self.graph(*args)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a worker's other threads (the accuracy guard's reference calls, a
            # catalog's pinned copy) keep using CUDA while a call captures; "global" would fail it
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = self.graph(*args)
        except RuntimeError as e:
            log.warning("CUDA graph capture failed, running without CUDA graphs: %s", e)
            self.graphs.clear()
            self.failed = True
            return None
        self.pool = graph.pool()
        graph.replay()
        self.graphs[key] = (graph, outputs)
        return outputs
