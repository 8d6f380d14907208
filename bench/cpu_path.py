"""The handler's work outside the graph call, on CPU: respond_batch (parse, tokenize, pack, decode,
JSON) for a batch of workload requests, with a stub graph that returns outputs of the right
shapes at once. It measures what a GPU call waits on in the worker, on any machine.

    python -m bench.cpu_path --tokenizer bench/assets/tokenizer.json [--batches 1,2,4] [--workloads W3,W2,W1,W1e]
"""

import argparse
import json
import statistics
import time

import torch
from tokenizers import Tokenizer

from bench.workloads import WORKLOADS, TextMaker
from slm_core.pieces import tokenizer_threads
from slm_core.serve.protocol import Request, respond_batch
from slm_core.serve.runtime import Runtime
from slm_core.spec import TaskSpec
from slm_core.tasks import Task, task_for


class StubGraph(torch.nn.Module):
    """A graph's outputs for the packed batch in the shapes of the task's signature, with no
    model: a row per text (of the labels, or of `hidden` values for an embedding), or beam
    candidates of token ids below `vocab`."""

    def __init__(self, task: Task, vocab: int, hidden: int):
        super().__init__()
        self.task, self.vocab, self.hidden = task, vocab, hidden

    def forward(self, ids: torch.Tensor, cu: torch.Tensor, *options: torch.Tensor):
        n, g = cu.shape[0] - 1, torch.Generator().manual_seed(0)
        if self.task.api == "score":
            return torch.rand(n, len(self.task.labels), generator=g)
        if self.task.api == "embed":
            return torch.rand(n, self.hidden, generator=g)
        w, k = self.task.width, self.task.new_tokens
        return (
            torch.randint(0, self.vocab, (n, w, k), generator=g),
            torch.full((n, w), k),
            -torch.rand(n, w, generator=g),
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--workloads", default="W3,W2,W1")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--calls", type=int, default=40, help="calls per timing; the median of 5 timings is reported")
    args = p.parse_args()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    print(f"tokenizer threads: {tokenizer_threads()}")  # the pieces' share follows them (RAYON_NUM_THREADS)
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        batches = [int(b) for b in args.batches.split(",")]
        task = task_for(TaskSpec.from_dict({**workload.task, "max_batch": max(batches)}), tokenizer)
        engine = Runtime(StubGraph(task, tokenizer.get_vocab_size(), workload.arch["hidden_size"]), task, "cpu")
        bodies = [
            Request({"body": json.dumps(b).encode()})
            for b in TextMaker(tokenizer, seed=2).requests(workload, max(batches))
        ]
        for b in batches:
            respond_batch(engine, bodies[:b])  # warm up
            timings = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(args.calls):
                    respond_batch(engine, bodies[:b])
                timings.append((time.perf_counter() - start) / args.calls * 1e3)
            print(f"{name} batch of {b}: {statistics.median(timings):.3f} ms per call outside the graph")


if __name__ == "__main__":
    main()
