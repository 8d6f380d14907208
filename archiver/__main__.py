"""python -m archiver build --checkpoint PATH --task TASK.yaml --model-name NAME --export-path DIR [--device cpu|cuda]"""

import argparse
import sys

from slm_core.errors import SpecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slm-archiver", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a checkpoint for a task into NAME.mar")
    b.add_argument("--checkpoint", required=True, help="HF-style directory or .gguf file")
    b.add_argument("--task", required=True, help="task YAML (see DESIGN.md)")
    b.add_argument("--model-name", required=True)
    b.add_argument("--export-path", required=True, help="directory that receives NAME.mar")
    b.add_argument("--device", default="cpu", help="cpu or cuda: where the archive will serve (build there)")
    b.add_argument("--workers", type=int,
                   help="TorchServe workers for this model (model-config.yaml); default: CUDA score tasks 1 and "
                        "beam tasks 2 per GPU of --device-ids, CPU 1 (archiver.build.serving_defaults)")
    b.add_argument("--response-timeout", type=int, default=120, help="seconds before TorchServe restarts a worker")
    b.add_argument("--attention", choices=["reference", "triton"],
                   help="attention compiled into the graph: triton (CUDA only; the default there, faster at "
                        "every measured shape, bench/RESULTS.md) or the PyTorch reference (the CPU default)")
    b.add_argument("--topk", choices=["torch", "triton"],
                   help="beam tasks: the vocabulary top-k + logsumexp of each step, torch.topk (the CPU default) "
                        "or Triton group maxima then torch.topk over the best groups (kernels/vocab_topk.py; CUDA "
                        "only, the default there: 1.6-3.1x faster per step, bench/RESULTS.md)")
    b.add_argument("--cuda-graphs", choices=["on", "lazy", "off"], default="on",
                   help="CUDA builds: replay each call from a CUDA graph captured per input-size bucket, every "
                        "bucket as a worker loads (on) or each on its first call (lazy: faster load, but a call "
                        "that captures takes about three calls' time)")
    b.add_argument("--batch-delay-ms", type=int, default=1,
                   help="longest wait for more requests to batch (up to the task's max_batch, split between "
                        "the sync workers of one GPU: archiver.build.worker_batch); at least 1 (TorchServe reads "
                        "0 in an archive as unset: 100 ms)")
    b.add_argument("--queue", type=int,
                   help="requests that may wait for a worker; beyond them TorchServe answers 503 at once "
                        "(default: as many as finish within --deadline-ms behind the calls that run at once, from "
                        "the calls timed at build, archiver.build.admission; "
                        "100 on CPU builds without --deadline-ms)")
    b.add_argument("--deadline-ms", type=float,
                   help="latency a queued request must still meet, sizing the queue when --queue is not given "
                        "(default 80 on CUDA builds; CPU builds, a development path, queue 100)")
    b.add_argument("--fp8-max-diff", type=float, default=0.05,
                   help="fp8 precisions, score tasks: the largest |difference| of a label probability from the "
                        "bf16 graph allowed on the evaluation texts (the accuracy gate; the build fails above it)")
    b.add_argument("--fp8-min-shared", type=float, default=0.6,
                   help="fp8 precisions, beam tasks: the least mean share of the bf16 graph's W candidates the "
                        "fp8 graph must also return on the evaluation prompts (the build fails below it)")
    b.add_argument("--device-ids", type=_ids,
                   help="CUDA builds: the GPUs this model's workers go to in turn, e.g. 0,1 (TorchServe's deviceIds; "
                        "default: every GPU of the host, in turn with the other models' workers); the queue "
                        "for --deadline-ms grows with their number")
    b.add_argument("--contexts", type=int,
                   help="request contexts per worker: 0 serves in TorchServe's sync mode (a worker takes one batch "
                        "at a time); N >= 1 in its async mode, N graph calls at once in one worker, each on its own "
                        "CUDA stream (slm_core.scheduler; the queue then waits inside the worker). Default 0: two sync "
                        "workers per GPU (archiver.build.serving_defaults says why)")
    args = parser.parse_args(argv)
    if args.contexts is not None and args.contexts < 0:
        parser.error("--contexts must be 0 (sync) or a positive number of request contexts")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    attention = args.attention or ("triton" if args.device.startswith("cuda") else "reference")
    topk = args.topk or ("triton" if args.device.startswith("cuda") else "torch")

    from archiver.build import build

    try:
        build(args.checkpoint, args.task, args.model_name, args.export_path, args.device, args.workers,
              args.response_timeout, attention, args.batch_delay_ms, args.queue, args.cuda_graphs != "off",
              args.deadline_ms, topk, args.device_ids, args.cuda_graphs == "on", args.fp8_max_diff,
              args.fp8_min_shared, args.contexts)
    except (SpecError, FileNotFoundError) as e:
        print(f"slm-archiver: error: {e}", file=sys.stderr)
        return 2
    return 0


def _ids(text: str) -> list[int]:
    try:
        ids = [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU indices") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices are distinct and not negative")
    return ids


if __name__ == "__main__":
    sys.exit(main())
