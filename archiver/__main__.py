"""slm-archiver: build a TorchServe archive for a task, or configure a new one from a built archive.

slm-archiver build --checkpoint PATH --task TASK.yaml --model-name NAME --export-path DIR [--device cpu|cuda]
slm-archiver configure --archive NAME.mar --export-path DIR [--model-name NEW] [serving flags]
slm-archiver catalog --archive NAME.mar --catalog ITEMS.jsonl --version V --export-path DIR
slm-archiver publish --archive NAME.mar --catalog ITEMS.jsonl --store DIR --version V [--no-activate]
slm-archiver activate --store DIR --version V
slm-archiver rollback --store DIR

A catalog store (docs/operations.md, A new catalog) replaces a running catalog model's catalog in
place: build or configure the archive with --catalog-store DIR, then `publish` each new catalog
into DIR; every worker serves the active version within a second, and `rollback` returns to the
one before it.
"""

import argparse
import sys
from pathlib import Path

from slm_core.errors import SpecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slm-archiver", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a checkpoint for a task into NAME.mar")
    b.add_argument("--checkpoint", required=True, help="HF-style directory or .gguf file")
    b.add_argument("--task", required=True, help="task YAML (README.md, Tasks)")
    b.add_argument("--model-name", required=True)
    b.add_argument("--export-path", required=True, help="directory that receives NAME.mar")
    b.add_argument("--device", default="cpu", help="cpu or cuda: where the archive will serve (build there)")
    b.add_argument(
        "--fp8-max-diff",
        type=float,
        help="precision fp8-static, score tasks: the largest |difference| of a label probability from "
        "the bf16 graph allowed on the evaluation texts (the accuracy gate, default 0.05; the build "
        "fails above it)",
    )
    b.add_argument(
        "--fp8-min-shared",
        type=float,
        help="precision fp8-static, beam tasks: the least mean share of the bf16 graph's W candidates "
        "the fp8 graph must also return on the evaluation prompts (default 0.6; the build fails "
        "below it)",
    )
    b.add_argument("--version", default="1.0", help="the model version TorchServe registers it as (default 1.0)")
    b.add_argument(
        "--accuracy-reference",
        action=argparse.BooleanOptionalAction,
        help="also compile the task in the next precision up (fp8-static: bf16; bf16: fp32) for the online "
        "accuracy guard (--accuracy-sample); default: on for CUDA builds in fp8-static or bf16",
    )
    _serving_flags(b)
    c = sub.add_parser("configure", help="a new archive from a built one with other serving settings (no recompile)")
    c.add_argument("--archive", required=True, help="a built NAME.mar")
    c.add_argument("--export-path", required=True, help="directory that receives the new archive")
    c.add_argument("--model-name", help="the new archive's name (default: the built one's)")
    c.add_argument("--version", help="its model version (default: the built one's)")
    _serving_flags(c)
    k = sub.add_parser("catalog", help="a new version of a catalog task's archive with another catalog (no recompile)")
    k.add_argument("--archive", required=True, help="a built NAME.mar of a task with a catalog")
    k.add_argument("--catalog", required=True, help="the new catalog, JSONL (README.md, Tasks)")
    k.add_argument(
        "--version", required=True, help="the new archive's model version; it is written as NAME-VERSION.mar"
    )
    k.add_argument("--export-path", required=True, help="directory that receives the new archive")
    k.add_argument("--model-name", help="the model name (default: the built one's)")
    pub = sub.add_parser("publish", help="a new catalog into a catalog store, checked and built, then served")
    pub.add_argument("--archive", required=True, help="the served NAME.mar (its task checks the catalog)")
    pub.add_argument("--catalog", required=True, help="the new catalog, JSONL (README.md, Tasks)")
    pub.add_argument("--store", required=True, help="the store's directory (the archive's --catalog-store)")
    pub.add_argument("--version", required=True, help="its version name, new to the store: letters, digits, . _ -")
    pub.add_argument("--no-activate", action="store_true", help="publish only; `activate` serves it later")
    a = sub.add_parser("activate", help="serve a published catalog version (or 'archive': the archive's own)")
    a.add_argument("--store", required=True)
    a.add_argument("--version", required=True)
    r = sub.add_parser("rollback", help="serve the catalog version that was active before the current one")
    r.add_argument("--store", required=True)
    args = parser.parse_args(argv)

    from archiver.build import BuildConfig, build, catalog, configure, publish
    from slm_core.catalog_store import CatalogStore
    from slm_core.compile.checks import GateThresholds
    from slm_core.serving import ServingOptions

    try:
        if args.command == "catalog":
            catalog(args.archive, args.catalog, args.export_path, args.version, args.model_name)
            return 0
        if args.command == "publish":
            publish(args.archive, args.catalog, args.store, args.version, not args.no_activate)
            return 0
        if args.command == "activate":
            CatalogStore(args.store).activate(args.version)
            print(f"slm-archiver: serving catalog version {args.version} from {args.store}", file=sys.stderr)
            return 0
        if args.command == "rollback":
            version = CatalogStore(args.store).rollback()
            print(f"slm-archiver: rolled back: serving catalog version {version} from {args.store}", file=sys.stderr)
            return 0
        serving = ServingOptions(
            **given(
                workers=args.workers,
                queue=args.queue,
                deadline_ms=args.deadline_ms,
                batch_delay_ms=args.batch_delay_ms,
                response_timeout_s=args.response_timeout,
                device_ids=tuple(args.device_ids) if args.device_ids else None,
                cuda_graphs=False if args.no_cuda_graphs else None,
                catalog_store=str(Path(args.catalog_store).resolve()) if args.catalog_store else None,
                accuracy_sample=args.accuracy_sample,
                accuracy_max_diff=args.accuracy_max_diff,
                accuracy_min_shared=args.accuracy_min_shared,
            )
        )
        if args.command == "build":
            gate = GateThresholds(**given(max_diff=args.fp8_max_diff, min_shared=args.fp8_min_shared))
            build(
                BuildConfig(
                    args.checkpoint,
                    args.task,
                    args.model_name,
                    args.export_path,
                    args.device,
                    serving,
                    gate,
                    args.version,
                    args.accuracy_reference,
                )
            )
        else:
            configure(args.archive, args.export_path, serving, args.model_name, args.version)
    except (SpecError, FileNotFoundError) as e:
        print(f"slm-archiver: error: {e}", file=sys.stderr)
        return 2
    return 0


def _serving_flags(p: argparse.ArgumentParser) -> None:
    """The ServingOptions of slm_core.serving (which refuses bad values); each left out takes its
    default (docs/operations.md, Defaults)."""
    p.add_argument(
        "--workers", type=int, help="TorchServe workers for this model (default: 2 per GPU on CUDA, 1 on CPU)"
    )
    p.add_argument(
        "--queue",
        type=int,
        help="requests that may wait for a worker; beyond them TorchServe answers 503 at once (default: "
        "as many as finish within --deadline-ms, from the calls timed at build)",
    )
    p.add_argument(
        "--deadline-ms",
        type=float,
        help="the latency a queued request must still meet, sizing the queue when --queue is not given "
        "(default 80 on CUDA builds; CPU builds, for development, queue 100)",
    )
    p.add_argument(
        "--batch-delay-ms",
        type=int,
        help="the longest wait for more requests to batch into a call (default 1); at least 1 "
        "(TorchServe reads 0 in an archive as unset: 100 ms)",
    )
    p.add_argument(
        "--response-timeout",
        type=int,
        help="seconds a call may take before TorchServe restarts its worker (default 120)",
    )
    p.add_argument(
        "--device-ids",
        type=_ids,
        help="CUDA builds: the GPUs this model's workers go to in turn, e.g. 0,1 (default: every GPU of "
        "the host, in turn with the other models' workers); the queue grows with their number",
    )
    p.add_argument(
        "--accuracy-sample",
        type=float,
        help="archives with an accuracy reference: the share of live requests it recomputes off the hot path "
        "(default 0.001; 0 turns the guard off)",
    )
    p.add_argument(
        "--accuracy-max-diff",
        type=float,
        help="score tasks: a sampled request whose |difference| of a probability from the reference passes "
        "this is a breach (default 0.05)",
    )
    p.add_argument(
        "--accuracy-min-shared",
        type=float,
        help="beam tasks: a sampled request sharing fewer of the reference's candidates is a breach (default 0.6)",
    )
    p.add_argument(
        "--catalog-store",
        help="catalog tasks: a directory of catalog versions (slm-archiver publish) that every worker "
        "follows, swapping the active one in place (docs/operations.md, A new catalog)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="CUDA builds: run calls without CUDA graphs (slower; saves the GPU memory their capture "
        "reserves, GiBs per worker)",
    )


def given(**values) -> dict:
    """The flags given: a spec's own defaults stand for the rest."""
    return {k: v for k, v in values.items() if v is not None}


def _ids(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU indices") from None


if __name__ == "__main__":
    sys.exit(main())
