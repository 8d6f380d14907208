"""Frozen, typed specs: model architecture, task YAML, runtime. Parsed once; unknown keys are
errors. What a task kind means by its keys is the task's own (slm_core.tasks)."""

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from slm_core.errors import SpecError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# precision -> the model's dtype; fp8-static keeps bf16 outside its E4M3 linears (slm_core.compile.fp8)
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp8-static": "bfloat16"}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim/2] fp32 inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS compute them."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.type == "linear":
            return inv / self.factor
        if self.type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "RopeSpec":
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise SpecError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
        kwargs: dict[str, Any] = {
            k: float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor") if k in params
        }
        if "original_max_position_embeddings" in params:
            kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return cls(theta=float(theta), type=kind, **kwargs)


@dataclass(frozen=True)
class ModelSpec:
    arch: Literal["llama", "qwen2", "qwen3"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool = False  # qwen2: always; llama/qwen3: `attention_bias`
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise SpecError(f"architecture {self.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelSpec":
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise SpecError(f"config.json model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise SpecError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise SpecError("config.json use_sliding_window=true is not supported")
        heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class TaskSpec:
    """The task YAML (README.md, Tasks; docs/tasks.md). Bounds are fixed at build time; requests beyond
    them are refused. Keys a kind does not use keep their defaults."""

    task: str  # the kind: score | beam (slm_core.tasks)
    prompt_template: str | None = None  # the kind's placeholder ("{text}", "{prompt}") is replaced
    labels: tuple[str, ...] = ()
    max_texts: int = 32
    max_text_tokens: int = 512
    beam_width: int = 100
    new_tokens: int = 5
    max_prompt_tokens: int = 512
    stop: tuple[str, ...] = ()
    precision: str = "bf16"
    max_batch: int | None = None  # requests in one graph call at most; None: the kind's default for the device
    # score tasks: where a text's row comes from, at its last token: "labels", the LM head's rows
    # of the label tokens; "classifier", the checkpoint's sequence-classification head;
    # "embedding", the hidden state itself. output: "probs" (softmax over the row) or "logits"
    # (the row itself).
    head: str = "labels"
    output: str = "probs"
    # head: embedding: the first `dims` dimensions of the hidden state (None: all of them;
    # Matryoshka-style truncation), then L2-normalised if `normalize`.
    dims: int | None = None
    normalize: bool = False
    # head: mlp: a safetensors file (relative to the task YAML) holding an MLP over that embedding
    # (slm_core.compile.mlp_head says its layout); its output row per text, as a classifier's.
    mlp: str | None = None
    # Special tokens spelled in a request's text are tokenized as plain text unless this is true
    # (slm_core.tokenizer): only the template's own are matched.
    allow_special_tokens: bool = False
    # beam tasks: generative retrieval over a catalog (slm_core.item_trie), a JSONL file relative to
    # the task YAML; its bounds (a catalog swapped in later must fit them); the most item ids a
    # request may exclude; what a candidate's score normalises over: "vocab", the whole
    # vocabulary (transformers'), or "catalog", only the tokens the catalog uses (the LM head then
    # computes only their rows).
    catalog: str | None = None
    max_items: int = 1_048_576
    max_trie_nodes: int = 4_194_304
    max_exclude: int = 32
    catalog_scores: str = "vocab"

    def __post_init__(self):
        if not isinstance(self.task, str):
            raise SpecError(f"task key 'task' must be a string, got {self.task!r}")
        for name in (
            "max_texts",
            "max_text_tokens",
            "beam_width",
            "new_tokens",
            "max_prompt_tokens",
            "max_items",
            "max_trie_nodes",
            "max_exclude",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SpecError(f"task key {name!r} must be a positive integer, got {value!r}")
        if self.max_batch is not None and (type(self.max_batch) is not int or self.max_batch < 1):
            raise SpecError(f"task key 'max_batch' must be a positive integer, got {self.max_batch!r}")
        if self.precision not in PRECISIONS:
            raise SpecError(f"task key 'precision' must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.prompt_template is not None and not isinstance(self.prompt_template, str):
            raise SpecError(f"task key 'prompt_template' must be a string, got {self.prompt_template!r}")
        for name in ("labels", "stop"):
            items = getattr(self, name)
            if not all(isinstance(s, str) and s for s in items):
                raise SpecError(f"task key {name!r} must be a list of non-empty strings, got {list(items)!r}")
        for name in ("catalog", "mlp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SpecError(f"task key {name!r} must be a file path, got {value!r}")
        if self.catalog_scores not in ("vocab", "catalog"):
            raise SpecError(f"task key 'catalog_scores' must be 'vocab' or 'catalog', got {self.catalog_scores!r}")
        if self.dims is not None and (type(self.dims) is not int or self.dims < 1):
            raise SpecError(f"task key 'dims' must be a positive integer, got {self.dims!r}")
        if type(self.normalize) is not bool:
            raise SpecError(f"task key 'normalize' must be true or false, got {self.normalize!r}")
        if type(self.allow_special_tokens) is not bool:
            raise SpecError(f"task key 'allow_special_tokens' must be true or false, got {self.allow_special_tokens!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TaskSpec":
        if not isinstance(data, Mapping):
            raise SpecError(f"a task spec must be a mapping, got {type(data).__name__}")
        kwargs = _known_keys(cls, data, "task spec")
        if "task" not in kwargs:
            raise SpecError("task spec is missing the key 'task' (score | beam)")
        for name in ("labels", "stop"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise SpecError(f"task key {name!r} must be a list of strings, got {kwargs[name]!r}")
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def load(cls, source: "str | Path | Mapping[str, Any] | TaskSpec") -> "TaskSpec":
        """A TaskSpec from itself, a mapping, or a YAML file path."""
        if isinstance(source, TaskSpec):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        with open(source, encoding="utf-8") as f:
            return cls.from_dict(yaml.safe_load(f) or {}).located(Path(source).parent)

    def located(self, root: "str | Path") -> "TaskSpec":
        """The spec with its file keys (catalog, mlp) taken relative to `root` (a YAML's folder, a
        package)."""
        files = {name: str(Path(root) / value) for name in ("catalog", "mlp") if (value := getattr(self, name))}
        return dataclasses.replace(self, **files) if files else self

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class RuntimeSpec:
    """Where the engine runs, and with which kernels: "triton" (slm_kernels/, compiled for CUDA; the
    CPU interpreter in tests) or "reference" (their PyTorch references: CPU, and test oracles).
    Left out, the device decides: Triton on CUDA, the references on CPU, where AOTInductor
    cannot compile a graph holding a Triton kernel. Fixed when a graph is built."""

    device: str = "cpu"
    kernels: str | None = None

    def __post_init__(self):
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise SpecError(f"runtime device {self.device!r} is not a device: {e}") from None
        if dev.type not in ("cpu", "cuda"):
            raise SpecError(f"runtime device {self.device!r}: only cpu and cuda are supported")
        if self.kernels is None:
            object.__setattr__(self, "kernels", "triton" if dev.type == "cuda" else "reference")
        if self.kernels not in ("reference", "triton"):
            raise SpecError(f"runtime kernels must be 'reference' or 'triton', got {self.kernels!r}")


def _known_keys(cls, data: Mapping[str, Any], what: str) -> dict[str, Any]:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(known)})"
            raise SpecError(f"unknown key {key!r} in {what}{hint}")
    return dict(data)
