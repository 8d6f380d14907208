"""The package a build writes and a worker loads: a directory (inside the .mar) holding the
compiled graph, the tokenizer and manifest.json, which is all the serving side reads: nothing is
inferred from file names. The manifest holds the task (its YAML, bounds resolved), the model's
architecture, where and with what it was built, the request path as nodes (Task.pipeline), the
build's checks and its call timings."""

import json
from pathlib import Path
from typing import Any

import torch

from slm_core.errors import SpecError

FORMAT = 5  # the request path as nodes; the task's max_batch resolved; beam graphs take options
MANIFEST, GRAPH, TOKENIZER = "manifest.json", "graph.pt2", "tokenizer.json"
REFERENCE = "reference.pt2"  # the accuracy guard's graph, in a higher precision (slm_core.serve.accuracy_guard)
# the precision a reference graph computes in, per archive precision
REFERENCE_PRECISION = {"fp8-static": "bf16", "bf16": "fp32"}


def read(package: Path) -> dict[str, Any]:
    """A package's manifest, refused (SpecError, with the reason) when this worker cannot run it:
    another format, torch version or device type."""
    manifest = check_format(json.loads((Path(package) / MANIFEST).read_text()))
    built = manifest["versions"]
    if built["torch"] != torch.__version__:
        raise SpecError(
            f"package was built with torch {built['torch']}, this worker has {torch.__version__}: "
            "rebuild it on this machine type"
        )
    if manifest["device"] == "cuda" and not torch.cuda.is_available():
        raise SpecError("package was built for cuda, but this worker has no CUDA device: rebuild with --device cpu")
    return manifest


def check_format(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest, if this version reads its format (SpecError otherwise)."""
    if manifest.get("format") != FORMAT:
        raise SpecError(f"package format {manifest.get('format')!r} is not {FORMAT}: rebuild it with this version")
    return manifest


def node(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """The request path's node `name` (encode, graph, decode)."""
    for n in manifest["pipeline"]:
        if n["node"] == name:
            return n
    raise SpecError(f"the manifest's request path has no {name!r} node: rebuild the package")
