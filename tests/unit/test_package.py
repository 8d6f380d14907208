"""Built packages and archives: compiled equal to eager, the manifest's contents and request path,
refusal of what a worker cannot run, and archives configured anew from a built one."""

import json
import re
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import BEAM_TASK, SCORE_TASK

from slm_core import Engine, SpecError
from slm_core.manifest import MANIFEST
from slm_core.serve.loader import load_package
from slm_core.serving import ServingOptions, ServingSpec

TEXTS = ["a", "search engines rank documents", "the lazy dog " * 4, "12, 345 and 6789", "x y", "beam", "fox", "z"]


def test_compiled_score_equals_eager(archives):
    compiled = Engine.from_package(archives["tiny_score"])
    eager = Engine.from_checkpoint(archives["checkpoint"], task=SCORE_TASK)
    for texts in (TEXTS[:1], TEXTS[1:3], TEXTS):
        for row, ref in zip(compiled.score(texts), eager.score(texts)):
            assert row == pytest.approx(ref, abs=1e-5)
    assert compiled.score(TEXTS) == compiled.score(TEXTS)


def test_compiled_beam_equals_eager(archives):
    compiled = Engine.from_package(archives["tiny_beam"])
    eager = Engine.from_checkpoint(archives["checkpoint"], task=BEAM_TASK)
    for prompt in ("a", "a small language model", "search engines rank documents for a query"):
        ours, ref = compiled.beam(prompt), eager.beam(prompt)
        assert [c["token_ids"] for c in ours] == [c["token_ids"] for c in ref]
        for c, r in zip(ours, ref):
            assert c["score"] == pytest.approx(r["score"], abs=1e-5)
    assert compiled.beam("a small language model") == compiled.beam("a small language model")


def test_compiled_graphs_take_a_batch_of_any_size_up_to_max_batch(archives):
    """The archives batch requests (score max_batch 3, beam 2): every batch size from 1 to the
    bound runs in one compiled call and answers each request as its own call does."""
    score = Engine.from_package(archives["tiny_score"])
    requests = [TEXTS[:1], TEXTS[1:3], TEXTS]
    for size in (1, 2, 3):
        for texts, result in zip(requests, score.run(requests[:size])):
            assert result.stats.batch == size
            for row, ref in zip(result.answer, score.score(texts)):
                assert row == pytest.approx(ref, abs=1e-6)
    beam = Engine.from_package(archives["tiny_beam"])
    prompts = ["a", "search engines rank documents for a query"]
    for size in (1, 2):
        for prompt, result in zip(prompts, beam.run(prompts[:size])):
            assert result.stats.batch == size
            assert [c["token_ids"] for c in result.answer] == [c["token_ids"] for c in beam.beam(prompt)]


def test_manifest_records_the_task_its_request_path_and_the_build(archives):
    manifest = json.loads((archives["tiny_score"] / MANIFEST).read_text())
    assert manifest["device"] == "cpu" and manifest["dtype"] == "float32" and manifest["kernels"] == "reference"
    assert manifest["task"]["labels"] == ["yes", "no"] and manifest["task"]["max_batch"] == 3
    assert manifest["architecture"]["arch"] == "qwen3" and manifest["versions"]["torch"] == torch.__version__
    assert manifest["check"]["max_abs_diff"] <= manifest["check"]["tolerance"]
    encode, graph, decode = manifest["pipeline"]
    assert (encode["op"], graph["file"], decode["op"]) == ("LabelsTask.encode", "graph.pt2", "LabelsTask.unpack")
    assert "cu_seqlens" in " ".join(graph["inputs"]) and len(graph["constants"]["label_ids"]) == 2
    beam = json.loads((archives["tiny_beam"] / MANIFEST).read_text())
    assert beam["pipeline"][1]["constants"]["stop_ids"] and beam["check"]["shared_candidates"] == 1.0
    assert set(beam["call_ms"]) == {"1", "2"} and all(0 < ms < 60_000 for ms in beam["call_ms"].values())
    # calls by size, for deadlines: 1, 2 sequences (a full call of the beam's 2 prompts) of 1/8 ... all of the bound
    sizes = {(n, length): ms for n, length, ms in beam["call_ms_by_size"]}
    lengths = sorted({length for _, length in sizes})
    assert {n for n, _ in sizes} == {1, 2} and len(lengths) == 4 and lengths[-1] == beam["task"]["max_prompt_tokens"]
    assert all(0 < ms < 60_000 for ms in sizes.values())


def test_archives_carry_their_serving_spec_and_serve_time_sources_only(archives):
    """model-config.yaml holds the ServingSpec the archiver planned: tiny_score was built with
    --queue 30; tiny_beam with --deadline-ms 80, its queue sized from the calls it timed. The
    archive holds slm_core without its build half."""
    from archiver.build import read_manifest, read_serving
    from slm_core.serving import plan

    store = archives["store"]
    assert read_serving(store / "tiny_score.mar") == ServingSpec("cpu", 1, 3, 30)
    beam = read_serving(store / "tiny_beam.mar")
    manifest = read_manifest(store / "tiny_beam.mar")
    assert beam == plan(ServingOptions(deadline_ms=80), "cpu", 2, manifest["call_ms"])[0] and beam.deadline_ms == 80
    names = zipfile.ZipFile(store / "tiny_beam.mar").namelist()
    assert "slm_core/serve/runtime.py" in names and "slm_core/tasks/beam.py" in names
    assert not [n for n in names if n.startswith(("slm_core/compile/", "slm_core/api.py", "slm_kernels/"))]


def test_configure_writes_a_new_archive_of_the_same_package(archives, tmp_path):
    """archiver configure: the built package and sources as they are, another serving spec, in
    seconds; the new archive serves the same answers."""
    from archiver.__main__ import main
    from archiver.build import read_serving

    src = archives["store"] / "tiny_score.mar"
    # torch-model-archiver's own staging place for this name, taken (as by another build of it at
    # the same time): the build stages in its own temporary folder
    taken = Path(tempfile.gettempdir()) / "tiny_x2"
    taken.write_text("another build's")
    try:
        assert (
            main(
                [
                    "configure",
                    "--archive",
                    str(src),
                    "--export-path",
                    str(tmp_path),
                    "--model-name",
                    "tiny_x2",
                    "--workers",
                    "2",
                    "--queue",
                    "7",
                ]
            )
            == 0
        )
        assert taken.read_text() == "another build's"
    finally:
        taken.unlink()
    assert tempfile.gettempdir() == str(taken.parent)  # the process's temporary folder as it was
    assert read_serving(tmp_path / "tiny_x2.mar") == ServingSpec("cpu", 2, 2, 7)  # two workers split max_batch 3
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(tmp_path / "tiny_x2.mar") as b:
        same = [n for n in a.namelist() if not n.startswith("MAR-INF/") and n != "model-config.yaml"]
        assert "slm_handler.py" in same  # the archive's own handler, beside the sources it was built with
        assert sorted(same) == sorted(
            n for n in b.namelist() if not n.startswith("MAR-INF/") and n != "model-config.yaml"
        )
        assert all(a.read(n) == b.read(n) for n in same)
    zipfile.ZipFile(tmp_path / "tiny_x2.mar").extractall(tmp_path / "unpacked")
    assert Engine.from_package(tmp_path / "unpacked").score(TEXTS[:2]) == Engine.from_package(
        archives["tiny_score"]
    ).score(TEXTS[:2])
    # refused: writing over its source, and a package of another format (rebuild)
    assert main(["configure", "--archive", str(src), "--export-path", str(src.parent)]) == 2
    old = tmp_path / "old.mar"
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(old, "w") as b:
        for item in a.infolist():
            data = a.read(item.filename)
            b.writestr(item, json.dumps({**json.loads(data), "format": 3}) if item.filename == MANIFEST else data)
    assert main(["configure", "--archive", str(old), "--export-path", str(tmp_path / "o")]) == 2
    assert main(["configure", "--archive", str(tmp_path / "unpacked" / MANIFEST), "--export-path", str(tmp_path)]) == 2


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["versions"].update(torch="1.0.0"), "built with torch 1.0.0, this worker has"),
        (lambda m: m.update(format=99), "package format 99"),
        (lambda m: m["pipeline"][2].update(op="BeamTask.unpack"), "is not this version's for its task"),
        (lambda m: m.update(pipeline=m["pipeline"][:2]), "is not this version's for its task"),
        (lambda m: m.update(pipeline=m["pipeline"][::2]), "has no 'graph' node"),
    ],
)
def test_incompatible_packages_are_refused(archives, tmp_path, edit, message):
    copy = tmp_path / "pkg"
    shutil.copytree(archives["tiny_score"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    edit(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match=message):
        load_package(copy)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_package_refused_without_cuda(archives, tmp_path):
    copy = tmp_path / "pkg"
    shutil.copytree(archives["tiny_score"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["device"] = "cuda"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="built for cuda, but this worker has no CUDA device"):
        load_package(copy)


def test_triton_kernels_are_refused_on_cpu_builds(random_checkpoint, tmp_path):
    """The Triton kernels compile for CUDA only: a CPU build asked for them says so before compiling."""
    from slm_core.compile.checkpoint import load_checkpoint
    from slm_core.compile.package import build_package
    from slm_core.spec import RuntimeSpec, TaskSpec

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    task = TaskSpec.from_dict({"task": "beam", "beam_width": 2, "new_tokens": 2, "max_prompt_tokens": 16})
    with pytest.raises(SpecError, match="compile for CUDA only"):
        build_package(ckpt, task, RuntimeSpec("cpu", kernels="triton"), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_the_cli_refuses_bad_serving_flags_before_loading_anything(capsys):
    from archiver.__main__ import main

    base = ["build", "--checkpoint", "x", "--task", "t.yaml", "--model-name", "m", "--export-path", "o"]
    for argv in (["--device-ids", "0,a"], ["--contexts", "2"], ["--attention", "triton"]):
        with pytest.raises(SystemExit):
            main(base + argv)
    # refused before anything is loaded or compiled (the checkpoint "x" does not exist)
    for argv, message in (
        (["--batch-delay-ms", "0"], "waits 100 ms"),
        (["--workers", "0"], "workers must be"),
        (["--device-ids", "0,0"], "distinct and not negative"),
    ):
        assert main(base + argv) == 2
        assert message in capsys.readouterr().err
    assert main(base) == 2 and "t.yaml" in capsys.readouterr().err


class Residual(torch.nn.Module):
    """A small graph for compile_package: `layers` linears, each with its ReLU and residual add
    (one fused C++ kernel each on CPU)."""

    def __init__(self, layers: int):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(layers))

    def forward(self, x):
        for linear in self.linears:
            x = torch.relu(linear(x)) + x
        return x


def test_the_build_says_where_the_compile_time_went(tmp_path):
    """compile_package's progress line: AOTInductor's phases of this compile only, the largest
    first (a CPU compile's time is mostly its C++ compile)."""
    from slm_core.compile.export import compile_package

    program = torch.export.export(Residual(4), (torch.randn(4, 32),))
    said: list[str] = []
    took: list[float] = []
    for name in ("a.pt2", "b.pt2"):
        start = time.perf_counter()
        compile_package(program, str(tmp_path / name), said.append)
        took.append(time.perf_counter() - start)
    assert len(said) == 2 and all(line.startswith("AOTInductor's phases (s, nested): ") for line in said)
    for line, seconds in zip(said, took):
        phases = dict(p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split(", "))
        assert "compile_file" in phases, line
        assert list(map(float, phases.values())) == sorted(map(float, phases.values()), reverse=True)
        assert float(phases["compile_file"]) <= seconds + 0.1  # this compile's, not the process's so far


def test_a_cpu_graph_compiles_scalar_cpp_kernels_and_its_wrapper_at_o0(tmp_path):
    """compile_package writes a CPU graph's C++ kernels without Inductor's SIMD vectorization,
    which is a third of a CPU compile and none of a CPU call's time, and compiles its C++ wrapper
    at -O0 (at -O1 it was most of a 30-layer beam graph's C++ compile)."""
    from slm_core.compile.export import compile_package

    program = torch.export.export(Residual(1), (torch.randn(4, 32),))
    package = zipfile.ZipFile(compile_package(program, str(tmp_path / "small.pt2")))
    (kernels,) = [package.read(n).decode() for n in package.namelist() if n.endswith(".kernel.cpp")]
    assert "cpp_fused" in kernels and "at::vec" not in kernels
    # the compiler's options, as GCC records them in each compile unit's debug info (-g1)
    (library,) = [package.read(n) for n in package.namelist() if n.endswith(".so")]
    units = [re.findall(rb" -O[0-3s]\b", unit) for unit in set(re.findall(rb"GNU C\+\+[^\x00]*", library))]
    assert sorted(units) == [[b" -O0"], [b" -O3"]], units  # the wrapper's, the kernels'
