"""The Task interface: everything about one kind of request that is not the model.

A task owns its request path (the static DAG the manifest records): the request schema and its
validation, the CPU node that turns requests into the graph's packed inputs, the graph's
signature, the CPU node that turns the graph's outputs into answers, and how answers are judged
(compiled against eager, FP8 against bf16) and counted (FLOPs). Engine, protocol, replay, package
and bench code go through this interface; they never ask which kind a task is.

A task's graph is built by the build half (slm_core.compile.graphs.GRAPHS[task.graph]): a worker
runs the compiled graph and never imports it.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import Tokenizer

from slm_core.errors import InputError, SpecError, json_type, names
from slm_core.spec import ModelSpec, TaskSpec
from slm_core.tokenizer import PackedTokenizer


@dataclass(frozen=True)
class Difference:
    """Two answers to one request compared: the |differences| of the numbers they share
    (probabilities; shared candidates' scores), the share of the first's items the second also
    holds (1.0 for rows of numbers) and whether their best item is the same."""

    values: tuple[float, ...]
    shared: float = 1.0
    best_same: bool = True


@dataclass(frozen=True)
class Tensor:
    """A request field or an answer field as a tensor of KServe's Open Inference Protocol
    (slm_core.serve.kserve): its name, datatype and shape (-1: any length; (1,): one value, a
    scalar field), the body's field it is (`field`, default the name; `key`: the key of each of
    that field's objects, as beam candidates' "text") and whether a request may leave it out, or
    an answer lack it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    field: str = ""
    key: str | None = None
    optional: bool = False

    @property
    def source(self) -> str:
        return self.field or self.name


class Task(ABC):
    kind: ClassVar[str]  # the task YAML's `task`
    head: ClassVar[str | None] = None  # its `head`, where a kind has several
    api: ClassVar[str]  # the Engine method of the Python API that runs it
    field: ClassVar[str]  # the request body's one required field
    placeholder: ClassVar[str]  # replaced by the request's text in the template
    graph: ClassVar[str]  # its graph builder (slm_core.compile.graphs.GRAPHS)
    answer: ClassVar[tuple[str, ...]]  # the REST answer's fields
    # Whether a CUDA-graph bucket may add padding sequences (slm_core.serve.replay): they cost a
    # prefill's rows, or, for a beam, its W beams at every step.
    pad_sequences: ClassVar[bool]
    # max_batch when the task YAML names none, on CUDA: the best-served one (docs/operations.md, Defaults)
    cuda_max_batch: ClassVar[int]
    # compiled against eager on the check inputs: the largest allowed |difference| per precision
    tolerance: ClassVar[dict[str, float]]
    min_shared: ClassVar[dict[str, float]] = {}  # and the least share of items in common
    gate_requests: ClassVar[int | None] = None  # the FP8 gate's evaluation requests at most (None: every text)
    options_fields: ClassVar[tuple[str, ...]] = ()  # a request's optional fields beside `field`
    data_version: str = ""  # the version of the data it holds (with_data); "" for a task that holds none

    @classmethod
    def matches(cls, spec: TaskSpec) -> bool:
        """Whether a task YAML names this kind (`task`, and `head` where a kind has several)."""
        return spec.task == cls.kind and cls.head in (None, spec.head)

    def __init__(self, spec: TaskSpec, tokenizer: Tokenizer):
        if spec.max_batch is None:
            raise SpecError("the task's max_batch is not resolved (slm_core.tasks.task_for)")
        self.spec = spec
        self.tokenizer = PackedTokenizer(
            tokenizer, spec.prompt_template or self.placeholder, self.placeholder, spec.allow_special_tokens
        )

    # --- bounds ---------------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        """Requests one graph call holds at most."""
        return self.spec.max_batch

    @property
    @abstractmethod
    def request_sequences(self) -> int:
        """Packed sequences one request may bring."""

    @property
    @abstractmethod
    def sequence_tokens(self) -> int:
        """The token bound of one packed sequence, the template included."""

    @property
    def max_positions(self) -> int:
        """The longest sequence a call sees (RoPE's table)."""
        return self.sequence_tokens

    @property
    def call_texts(self) -> int:
        return self.max_batch * self.request_sequences

    @property
    def call_tokens(self) -> int:
        return self.call_texts * self.sequence_tokens

    @property
    def graph_texts(self) -> int:
        """Sequences the compiled graph accepts: a full call and room for a CUDA-graph bucket's
        padding sequences (slm_core.serve.replay: up to 1/16 of the tokens, plus one)."""
        return self.call_texts + self.call_texts // 16 + 2

    @property
    def graph_tokens(self) -> int:
        """Packed tokens the compiled graph accepts: a full call and a bucket's padding."""
        return 2 * self.call_tokens + 64

    # --- the request path -----------------------------------------------------------------------
    def request(self, payload: Any) -> Any:
        """A decoded request body -> the value the task encodes; InputError names what is wrong."""
        if not isinstance(payload, dict):
            raise InputError(
                f'request body must be a JSON object like {{"{self.field}": ...}}, got {json_type(payload)}'
            )
        unknown = set(payload) - {self.field, *self.options_fields}
        if self.field not in payload:
            raise InputError(
                f"request body is missing the field {self.field!r}" + (f" (got {names(unknown)})" if unknown else "")
            )
        if unknown:
            has = (
                f"{self.field!r} and optionally {', '.join(map(repr, self.options_fields))}"
                if self.options_fields
                else f"only {self.field!r}"
            )
            raise InputError(f"unknown fields {names(unknown)}; a {self.kind} request has {has}")
        return self.settings(payload)

    def settings(self, payload: dict) -> Any:
        """The request value of a body whose fields are the task's: its field's value, and what
        the optional fields ask (each checked against its bound)."""
        return payload[self.field]

    @abstractmethod
    def encode(self, values: list[Any]) -> "list[list[list[int]] | InputError]":
        """The CPU node before the graph: each request value -> its sequences' token ids, or the
        InputError that refuses it (its bound named). One tokenizer pass for all of them."""

    @property
    def option_columns(self) -> int:
        """Columns of the graph's `options` input, one row per sequence: what a request asks of
        its graph call (0: the graph takes no options)."""
        return 0

    def options(self, value: Any) -> list[int]:
        """A request value's row of the graph's options."""
        return []

    def graph_constants(self, sizes: list[int] | None = None) -> list | None:
        """Inputs the graph takes after the per-call ones, the same for every call (data the task
        holds, such as a catalog: swapped without a recompile), as CPU tensors; with `sizes`, each
        padded to that first dimension without changing an answer, or None where they do not fit."""
        return []

    def constant_bounds(self) -> list[int]:
        """The largest first dimension of each graph constant that the compiled graph accepts."""
        return []

    def constant_capacity(self, headroom: float) -> list[int]:
        """First dimensions for the graph constants' device buffers: this task's data, with room
        (`headroom`: a share of each size) for the data of a task swapped in later (with_data) to
        be copied in place."""
        return []

    def with_data(self, path: "str | Path", version: str) -> "Task":
        """This task over another version of its data (a file as write_data writes it): it serves
        the same requests. SpecError for a task that holds none, or data that breaks its bounds."""
        raise SpecError(f"a {self.kind} task holds no data that a running worker can swap")

    def write_data(self, package: Path) -> TaskSpec:
        """Write the data files the task holds (a catalog) into a package; returns the spec as the
        package records it (file keys relative to the package)."""
        return self.spec

    def host(self, output) -> Any:
        """A graph output (a CPU tensor) as unpack() takes it: nested lists."""
        return output.tolist()

    @abstractmethod
    def unpack(self, outputs: list, first: int, count: int, value: Any = None) -> Any:
        """The CPU node after the graph: the answer of the request `value` whose sequences are
        first..first+count-1, from the graph's outputs on the host (host())."""

    @abstractmethod
    def body(self, answer: Any) -> dict:
        """The REST answer (JSON-ready)."""

    @abstractmethod
    def v2_inputs(self) -> list[Tensor]:
        """The request's fields as Open Inference Protocol input tensors."""

    @abstractmethod
    def v2_outputs(self) -> list[Tensor]:
        """The answer's fields as Open Inference Protocol output tensors."""

    @abstractmethod
    def outputs(self) -> list[str]:
        """The graph's outputs: name, dtype, shape."""

    def extra_inputs(self) -> list[str]:
        """The graph's inputs after input_ids and cu_seqlens: name, dtype, shape."""
        return []

    def signature(self) -> dict[str, list[str]]:
        return {
            "inputs": [
                f"input_ids int32 [tokens <= {self.graph_tokens}]",
                f"cu_seqlens int32 [sequences + 1 <= {self.graph_texts + 1}]",
                *self.extra_inputs(),
            ],
            "outputs": self.outputs(),
        }

    def constants(self) -> dict:
        """What the graph holds of the task (token ids), for the manifest to say."""
        return {}

    def pipeline(self, device: str, graph_file: str) -> list[dict]:
        """The request path as the manifest records it and the loader runs it: CPU node ->
        compiled graph -> CPU node, with their interfaces and bounds."""
        name = type(self).__name__
        signature = self.signature()
        return [
            {
                "node": "encode",
                "device": "cpu",
                "op": f"{name}.encode",
                "input": f"request field {self.field!r}",
                "output": signature["inputs"],
                "bounds": {
                    "requests": self.max_batch,
                    "sequences_per_request": self.request_sequences,
                    "tokens_per_sequence": self.sequence_tokens,
                },
            },
            {"node": "graph", "device": device, "file": graph_file, **signature, "constants": self.constants()},
            {
                "node": "decode",
                "device": "cpu",
                "op": f"{name}.unpack",
                "input": signature["outputs"],
                "output": f"answer {list(self.answer)}",
            },
        ]

    # --- judging and counting (build and bench) -------------------------------------------------
    @abstractmethod
    def request_of(self, texts: list[str]) -> Any:
        """A request value made of sample texts (a request's worth of them), for the build's
        checks, FP8 calibration and accuracy gate."""

    @abstractmethod
    def difference(self, want: Any, got: Any) -> Difference:
        """Two answers to the same request compared."""

    def check(self, differences: list[Difference], precision: str) -> dict[str, Any]:
        """The compiled-against-eager verdict over the check requests, with "passes"."""
        worst = max((v for d in differences for v in d.values), default=0.0)
        result: dict[str, Any] = {
            "inputs": len(differences),
            "max_abs_diff": worst,
            "tolerance": self.tolerance[precision],
        }
        passes = worst <= self.tolerance[precision]
        if self.min_shared:
            shared = sum(d.shared for d in differences) / len(differences)
            result.update(shared_candidates=shared, min_shared=self.min_shared[precision])
            passes = passes and shared >= self.min_shared[precision]
        return {**result, "passes": passes}

    @abstractmethod
    def gate(self, differences: list[Difference], max_diff: float, min_shared: float) -> dict[str, Any]:
        """The FP8 accuracy verdict against bf16 on the evaluation requests, with "passes"."""

    @abstractmethod
    def flops(self, model: ModelSpec, value: Any, precision: str) -> tuple[int, int]:
        """A request's logical matrix FLOPs (slm_core.flops) and, of them, those run in E4M3."""

    def token_lengths(self, value: Any) -> list[int]:
        """The token count of each of a request's sequences, the template included."""
        encoded = self.encode([value])[0]
        if isinstance(encoded, InputError):
            raise encoded
        return [len(ids) for ids in encoded]
