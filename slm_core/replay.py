"""CUDA-graph replay of a compiled request graph, one captured graph per input-size bucket.

A call packs N sequences of T tokens; CUDA graphs need fixed shapes. So a call is padded up to a
bucket, T to within 1/16 of itself:
- score: N to the next power of two (at least N + 1, at most the task's call_texts + 1, more when
  the padding tokens need more sequences), by appending padding sequences (each at least one token
  and at most the task's per-sequence bound, so positions stay inside RoPE's table);
- beam: N stays as it is (a padding prompt would cost its W beams at every decode step, as much as
  a real one), and the padding tokens form a tail behind the last prompt that belongs to no
  sequence: the attention kernels never visit it, and nothing reads its rows (its RoPE positions
  are clamped to the table, slm_core.model).
Sequences do not see each other (block-diagonal prefill, per-prompt beams), so the real rows'
answers do not change, and the padding rows are never read. The compiled graph accepts these
sizes: slm_core.export exports up to TaskSpec.graph_tokens / graph_texts.

The first call of a bucket runs once on a side stream, then is captured: at worker load for every
bucket of bucket_grid (the handler setting capture_at_load, slm_core.package.capture_all), else on
the first served call of that size. Every later call of that bucket copies its inputs into the
static input buffers and replays (launches go from ~1,500 kernel launches from C++ to one graph
launch; bench/RESULTS.md). Each request context (slm_core.engine.Context) has its own CudaGraphs:
its graphs share one memory pool, which is safe because a context runs one call at a time and reads
its outputs before the next; contexts replay at once on their own streams, never sharing a pool.
A capture must not overlap another context's work, so with several contexts every graph is
captured at load, one context at a time, and then no more (CudaGraphs.sealed).
"""

import logging

import torch

from slm_core.spec import TaskSpec

log = logging.getLogger(__name__)
PAD_TOKEN = 0


def bucket(task: TaskSpec, sequences: int, tokens: int) -> tuple[int, int, list[int]] | None:
    """(bucket sequences, bucket tokens, lengths of the padding sequences) for a call of
    `sequences` sequences and `tokens` tokens, or None when no bucket can hold it. Padding tokens
    beyond the padding sequences are the unowned tail (beam tasks)."""
    if task.task == "beam":
        padded_t = _round_tokens(tokens)
        return (sequences, padded_t, []) if padded_t <= task.graph_tokens else None
    longest = task.sequence_tokens
    extra = min(1 << sequences.bit_length(), task.call_texts + 1) - sequences  # to a power of two > sequences
    padded_t = _round_tokens(tokens + extra)
    pad = padded_t - tokens
    extra = max(extra, -(-pad // longest))  # as many padding sequences as the padding tokens need
    if extra < 1 or sequences + extra > task.graph_texts or padded_t > task.graph_tokens:
        return None
    lengths = [pad // extra + (i < pad % extra) for i in range(extra)]
    return sequences + extra, padded_t, lengths


def bucket_grid(task: TaskSpec) -> list[tuple[int, int]]:
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


def pad_inputs(ids: torch.Tensor, cu: torch.Tensor, sequences: int, tokens: int,
               bucketed: tuple[int, int, list[int]]) -> tuple[int, int]:
    """Pad the packed call in the host buffers ids/cu (sized to the task's graph bounds) to its
    bucket: padding sequences of the bucket's lengths behind it, then the tail; returns the padded
    (sequences, tokens)."""
    padded_n, padded_t, lengths = bucketed
    if lengths:
        cu[sequences + 1 : padded_n + 1] = torch.tensor(lengths, dtype=cu.dtype).cumsum(0) + tokens
    ids[tokens:padded_t] = PAD_TOKEN
    return padded_n, padded_t


class CudaGraphs:
    """Replays `graph` (an AOTInductor package loaded with run_single_threaded=True) from CUDA
    graphs captured per bucket; at most `max_graphs` are captured (none once `sealed`), other sizes
    run the graph as is."""

    def __init__(self, graph, task: TaskSpec, device: torch.device, max_graphs: int = 256):
        self.graph = graph
        self.task = task
        self.device = device
        self.max_graphs = max_graphs
        self.ids = torch.zeros(task.graph_tokens, dtype=torch.int32, device=device)  # static inputs
        self.cu = torch.zeros(task.graph_texts + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None
        self.enabled = True
        self.sealed = False  # captures no more (slm_core.package.capture_all, several contexts)

    def __call__(self, ids: torch.Tensor, cu: torch.Tensor, sequences: int, tokens: int):
        """The graph's outputs (device tensors, valid until the next call) for the packed call in
        the pinned host buffers ids[:tokens], cu[:sequences + 1], or None when it does not replay."""
        if not self.enabled or (b := bucket(self.task, sequences, tokens)) is None:
            return None
        key = b[:2]
        if key not in self.graphs and (self.sealed or len(self.graphs) >= self.max_graphs):
            return None
        n, t = pad_inputs(ids, cu, sequences, tokens, b)
        self.ids[:t].copy_(ids[:t], non_blocking=True)
        self.cu[: n + 1].copy_(cu[: n + 1], non_blocking=True)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(n, t)
            except RuntimeError as e:  # something in the graph cannot be captured: run without graphs
                log.warning("CUDA graph capture failed, running without CUDA graphs: %s", e)
                self.enabled = False
                return None
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, n: int, t: int):
        """Capture on the caller's stream (its request context's), after a first run there outside
        the capture (lazy initialisation). PyTorch keeps a cuBLAS/cuBLASLt workspace per (handle,
        stream), and a graph bakes in the one of the stream it was captured on: torch.cuda.graph's
        default capture stream is one for all graphs, so every context's graphs would share one
        workspace and race when replayed at once. The first run allocates the stream's own
        workspace outside the graph's pool."""
        args = (self.ids[:t], self.cu[: n + 1])
        stream = torch.cuda.current_stream(self.device)
        self.graph(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            outputs = self.graph(*args)
        self.pool = graph.pool()
        return graph, outputs
