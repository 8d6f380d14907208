"""Build a TorchServe archive (.mar) for one task, configure a new archive from a built one, and
publish a catalog task's new catalogs into its store (slm_core.catalog_store).

The archive holds the compiled package (graph.pt2, tokenizer.json, manifest.json), the handler,
model-config.yaml (the ServingSpec) and the serve-time sources of slm_core, so it runs wherever
the runtime dependencies (torch of the same version, tokenizers, numpy, pyyaml) are installed.
"""

import dataclasses
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slm_core.compile.checkpoint import load_checkpoint
from slm_core.compile.checks import GateThresholds
from slm_core.compile.package import build_package
from slm_core.errors import SpecError
from slm_core.manifest import MANIFEST, REFERENCE_PRECISION, check_format
from slm_core.serving import ServingOptions, ServingSpec, plan
from slm_core.spec import RuntimeSpec, TaskSpec

HANDLER_MODULE = "handlers.slm_handler"
HANDLER_FILE = "slm_handler.py"  # the handler as TorchServe flattens it into the archive
MODEL_CONFIG = "model-config.yaml"
# What a worker imports: slm_core without its build half and the Python API that joins both (the
# compiled graph replaces the model).
SERVE_SOURCES = ("slm_core",)
BUILD_ONLY = {"compile", "api.py"}  # of slm_core's top level


@dataclass(frozen=True)
class BuildConfig:
    """One archive to build: `model_name`.mar into export_path, for `device`."""

    checkpoint: str  # an HF-style directory or a .gguf file
    task: "str | Path | Mapping[str, Any] | TaskSpec"  # a task YAML, or the parsed spec
    model_name: str
    export_path: str
    device: str = "cpu"  # where it will serve; build there
    serving: ServingOptions = field(default_factory=ServingOptions)
    gate: GateThresholds = field(default_factory=GateThresholds)
    version: str = "1.0"  # the archive's model version (TorchServe registers versions side by side)
    # the accuracy guard's reference graph (slm_core.serve.accuracy_guard); None: for fp8-static and
    # bf16 builds on CUDA (fp32 has no higher precision)
    reference: bool | None = None


def progress(message: str) -> None:
    print(f"[archiver {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(config: BuildConfig) -> Path:
    """Compile, check and time the task's graph, then write the archive with its serving spec."""
    spec = TaskSpec.load(config.task)
    export = Path(config.export_path)
    export.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{config.model_name}-") as tmp:
        stage = Path(tmp) / "stage"
        progress(f"loading checkpoint {config.checkpoint}")
        ckpt = load_checkpoint(config.checkpoint)
        _check_store(config.serving, spec)
        reference = config.reference
        if reference is None:
            reference = config.device.startswith("cuda") and spec.precision in REFERENCE_PRECISION
        manifest = build_package(ckpt, spec, RuntimeSpec(config.device), stage, progress, config.gate, reference)
        progress(f"compiled graph matches eager: {manifest['check']}")
        serving, note = plan(config.serving, config.device, manifest["task"]["max_batch"], manifest["call_ms"])
        progress(note)
        for name in SERVE_SOURCES:
            src = Path(importlib.util.find_spec(name).submodule_search_locations[0])

            def serve_time(folder: str, names: list[str], top=str(src)) -> set[str]:
                skip = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
                return skip | (BUILD_ONLY & set(names) if folder == top else set())

            shutil.copytree(src, stage / name, ignore=serve_time)
        handler = Path(importlib.util.find_spec(HANDLER_MODULE).origin)
        return _archive(stage, handler, serving, config.model_name, export, Path(tmp), config.version)


def configure(
    archive: "str | Path",
    export_path: "str | Path",
    options: ServingOptions,
    model_name: str | None = None,
    version: str | None = None,
) -> Path:
    """A new archive, `model_name` (default: the source's name).mar in export_path, holding the
    built one's package, sources and handler with a new serving spec: planned from `options`
    (what they leave open takes the defaults, as at build) and the manifest's call timings. No
    recompile: seconds."""
    archive = Path(archive)
    manifest = read_manifest(archive)
    _check_store(options, TaskSpec.from_dict(manifest["task"]))
    serving, note = plan(options, manifest["device"], manifest["task"]["max_batch"], manifest["call_ms"])
    progress(note)
    name = model_name or archive.stem
    export = Path(export_path)
    if (export / f"{name}.mar").resolve() == archive.resolve():
        raise SpecError(f"configure would write over {archive}: give another --model-name or --export-path")
    export.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        stage = _unpack(archive, Path(tmp))
        return _archive(
            stage, Path(tmp) / HANDLER_FILE, serving, name, export, Path(tmp), version or archive_version(archive)
        )


def catalog(
    archive: "str | Path",
    catalog_file: "str | Path",
    export_path: "str | Path",
    version: str,
    model_name: str | None = None,
) -> Path:
    """A new version of a catalog task's archive, `model_name`-`version`.mar in export_path: the
    built one's compiled graph, serving spec and handler with `catalog_file` (JSONL) in place of
    its catalog. The graph takes the catalog as inputs, so there is no recompile: seconds. The
    new catalog must fit the task's bounds."""
    from slm_core.manifest import GRAPH

    archive = Path(archive)
    manifest = read_manifest(archive)
    name = model_name or _model_name(archive)
    export = Path(export_path)
    target = export / f"{name}-{version}.mar"
    if target.resolve() == archive.resolve():
        raise SpecError(f"catalog would write over {archive}: give another --version or --export-path")
    task = _catalog_task(archive, catalog_file)
    export.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        stage = _unpack(archive, Path(tmp))
        manifest["task"] = task.write_data(stage).to_dict()
        manifest["pipeline"] = task.pipeline(manifest["device"], GRAPH)
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        progress(f"catalog: {task.catalog.summary()}")
        (Path(tmp) / "out").mkdir()
        mar = _archive(
            stage, Path(tmp) / HANDLER_FILE, read_serving(archive), name, Path(tmp) / "out", Path(tmp), version
        )
        shutil.move(mar, target)
    progress(f"done: {target}")
    return target


def publish(
    archive: "str | Path", catalog_file: "str | Path", store: "str | Path", version: str, activate: bool = True
) -> Path:
    """`catalog_file` (JSONL) as catalog version `version` of a catalog task's store, checked against
    the archive's task (its tokenizer, new tokens, stop tokens and bounds: a bad catalog is refused
    with the line that breaks them, and the store is left as it was) and built into the trie the
    workers load; then served by every worker following the store, unless activate is False."""
    from slm_core.catalog_store import CatalogStore, check_version

    check_version(version)
    task = _catalog_task(Path(archive), catalog_file)
    versions = CatalogStore(store)
    target = versions.publish(task.catalog, version, str(Path(catalog_file).resolve()))
    progress(f"published {target}: {task.catalog.summary()}")
    if activate:
        versions.activate(version)
        progress(f"activated {version}: workers following {store} serve it within a second")
    return target


def _catalog_task(archive: Path, catalog_file: "str | Path"):
    """The archive's catalog task over `catalog_file` (SpecError naming its line where it breaks
    the task's bounds)."""
    from tokenizers import Tokenizer

    from slm_core.manifest import TOKENIZER
    from slm_core.tasks import task_for

    manifest = read_manifest(archive)
    spec = TaskSpec.from_dict(manifest["task"])
    if spec.catalog is None:
        raise SpecError(f"{archive} serves a task without a catalog (task key 'catalog')")
    with zipfile.ZipFile(archive) as z:
        tokenizer = Tokenizer.from_str(z.read(TOKENIZER).decode("utf-8"))
    progress(f"building the catalog trie of {catalog_file}")
    return task_for(dataclasses.replace(spec, catalog=str(Path(catalog_file).resolve())), tokenizer, manifest["device"])


def _check_store(options: ServingOptions, spec: TaskSpec) -> None:
    if options.catalog_store and spec.catalog is None:
        raise SpecError("a catalog store (--catalog-store) serves catalog tasks only (task key 'catalog')")


def _unpack(archive: Path, tmp: Path) -> Path:
    """A built archive's package and sources into tmp/stage, its handler into tmp."""
    stage = tmp / "stage"
    with zipfile.ZipFile(archive) as z:
        members = [m for m in z.namelist() if not m.startswith("MAR-INF/") and m not in (MODEL_CONFIG, HANDLER_FILE)]
        z.extractall(stage, members)
        z.extract(HANDLER_FILE, tmp)
    return stage


def _mar_manifest(archive: "str | Path") -> dict[str, Any]:
    with zipfile.ZipFile(archive) as z:
        return json.loads(z.read("MAR-INF/MANIFEST.json"))


def archive_version(archive: "str | Path") -> str:
    """The model version an archive registers as."""
    return str(_mar_manifest(archive)["model"].get("modelVersion", "1.0"))


def _model_name(archive: "str | Path") -> str:
    return str(_mar_manifest(archive)["model"]["modelName"])


def read_manifest(archive: "str | Path") -> dict[str, Any]:
    """The package manifest inside a built archive of this format (SpecError otherwise)."""
    try:
        with zipfile.ZipFile(archive) as z:
            manifest = json.loads(z.read(MANIFEST))
    except (zipfile.BadZipFile, KeyError) as e:
        raise SpecError(f"{archive} is not an archive slm-archiver built: {e}") from None
    return check_format(manifest)


def read_serving(archive: "str | Path") -> ServingSpec:
    """The serving spec inside an archive."""
    with zipfile.ZipFile(archive) as z:
        return ServingSpec.from_model_config(yaml.safe_load(z.read(MODEL_CONFIG)))


def _archive(
    stage: Path, handler: Path, serving: ServingSpec, name: str, export: Path, tmp: Path, version: str
) -> Path:
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import generate_model_archive

    config = tmp / MODEL_CONFIG
    config.write_text(yaml.safe_dump(serving.model_config(), sort_keys=False))
    progress(
        f"serving: {serving.workers} worker(s) taking up to {serving.batch} request(s) per call, "
        f"queue {serving.queue}" + ("" if serving.cuda_graphs or serving.device == "cpu" else ", no CUDA graphs")
    )
    progress(f"writing {export / (name + '.mar')}")
    # torch-model-archiver stages the files in gettempdir()/NAME, so two builds of one name at once
    # (a baseline's beside this tree's) would write into and delete each other's: stage in ours
    shared, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        generate_model_archive(
            ModelArchiverConfig(
                model_name=name,
                handler=str(handler),
                version=version,
                extra_files=str(stage),
                export_path=str(export),
                # graph.pt2 is already a zip of weights: storing is as small and much faster
                archive_format="zip-store",
                force=True,
                config_file=str(config),
            )
        )
    finally:
        tempfile.tempdir = shared
    mar = export / f"{name}.mar"
    progress(f"done: {mar} ({mar.stat().st_size / 1e6:.0f} MB)")
    return mar
