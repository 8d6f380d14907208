"""Fixed beam search: a prompt -> its W best continuations of up to N new tokens, best first, each
with its token ids (the stop token included when it ended on one), its text (decoded without
special tokens) and its cumulative log-probability, as transformers' generate(num_beams=W,
num_return_sequences=W, early_stopping=True, length_penalty=0.0) ranks them.

W and N are the task's bounds; a request may ask for less of either (`beam_width`, `new_tokens`:
the search transformers runs at those settings) and for only its best `top` candidates. Requests
with different settings share a graph call: each prompt's settings are a row of the graph's
`options` input."""

from dataclasses import dataclass
from typing import Any, ClassVar

from slm_core import flops
from slm_core.errors import InputError, SpecError, json_type
from slm_core.spec import ModelSpec
from slm_core.tasks.base import Difference, Task, Tensor

# A candidate scored below this took a step the search could not take (the graphs score those
# -1e9, as transformers does, or -inf): what a prompt has fewer than W of is left out of its answer.
IMPOSSIBLE = -1.0e8


@dataclass(frozen=True)
class BeamRequest:
    """One prompt and what its request asks of the search (None: the task's bound)."""

    prompt: Any
    beam_width: int | None = None
    new_tokens: int | None = None
    top: int | None = None


class BeamTask(Task):
    kind = "beam"
    api = "beam"
    field = "prompt"
    placeholder = "{prompt}"
    graph = "beam"
    answer = ("candidates",)
    pad_sequences = False  # a padding prompt would cost W beams at every decode step
    # The best-served call size on the H200, split by two workers (bench/RESULTS.md).
    cuda_max_batch = 8
    # A shared candidate's score. It sums N bf16 log-probabilities over the whole vocabulary, as
    # far from fp32 as transformers' own bf16 beam scores are, and a compiled graph that fuses
    # differently from eager may differ by as much again. In fp32 a score is a sum of up to N
    # differences of two numbers of 10-30 (a logit, the vocabulary's logsumexp) whose GEMMs
    # compiled and eager block differently. fp8-static: compiled and eager quantise the post-norm
    # activations from different roundings (Inductor fuses the norm into the quantisation), values
    # near an E4M3 step land apart and beam search amplifies it; for it this check guards against a
    # broken compile only, and its accuracy criterion is the gate against bf16. bench/RESULTS.md
    # has the differences seen.
    tolerance: ClassVar[dict[str, float]] = {"fp32": 1e-3, "bf16": 0.25, "fp8-static": 0.5}
    min_shared: ClassVar[dict[str, float]] = {"fp32": 1.0, "bf16": 0.75, "fp8-static": 0.5}
    gate_requests = 8  # a prompt's call is the costly one
    options_fields = ("beam_width", "new_tokens", "top")  # a request's optional fields

    @classmethod
    def matches(cls, spec) -> bool:
        return spec.task == cls.kind and spec.catalog is None

    def __init__(self, spec, tokenizer):
        super().__init__(spec, tokenizer)
        if (spec.head, spec.output, spec.dims, spec.normalize, spec.mlp) != (
            "labels",
            "probs",
            None,
            False,
            None,
        ) or spec.labels:
            raise SpecError("task keys 'labels', 'head', 'output', 'dims', 'normalize' and 'mlp' are for score tasks")
        self.stop_ids = list(dict.fromkeys(self.tokenizer.single_tokens(spec.stop, "stop string")))  # once each

    @property
    def width(self) -> int:
        return self.spec.beam_width

    @property
    def new_tokens(self) -> int:
        return self.spec.new_tokens

    @property
    def request_sequences(self) -> int:
        return 1

    @property
    def sequence_tokens(self) -> int:
        return self.spec.max_prompt_tokens

    @property
    def max_positions(self) -> int:
        return self.spec.max_prompt_tokens + self.spec.new_tokens

    # --- a request's settings --------------------------------------------------------------------
    def settings(self, payload: dict) -> BeamRequest:
        """The request's prompt and settings, each checked against its bound."""
        return BeamRequest(
            payload[self.field],
            *(
                self._bounded(payload, name, bound)
                for name, bound in (("beam_width", self.width), ("new_tokens", self.new_tokens), ("top", self.width))
            ),
        )

    @staticmethod
    def _bounded(payload: dict, name: str, bound: int) -> int | None:
        value = payload.get(name)
        if value is None:
            return None
        if type(value) is not int or not 1 <= value <= bound:
            raise InputError(
                f"{name!r} must be an integer from 1 to {bound} (the archive's bound), got "
                + (str(value) if type(value) is int else json_type(value)),
                bound=name,
                limit=bound,
            )
        return value

    def value(self, value: Any) -> BeamRequest:
        """A request value as the task takes it: a BeamRequest, or a prompt alone."""
        return value if isinstance(value, BeamRequest) else BeamRequest(value)

    @property
    def option_columns(self) -> int:
        return 2

    def options(self, value: Any) -> list[int]:
        """The prompt's row of the graph's options: its beam width and new tokens."""
        value = self.value(value)
        return [value.beam_width or self.width, value.new_tokens or self.new_tokens]

    # --- the request path ------------------------------------------------------------------------
    def encode(self, values: list[Any]) -> "list[list[list[int]] | InputError]":
        bound = self.spec.max_prompt_tokens
        out: list = []
        for prompt in (self.value(v).prompt for v in values):
            try:
                self.tokenizer.check(prompt, "prompt", "max_prompt_tokens", bound)
                out.append(None)
            except InputError as e:
                out.append(e)
        valid = [i for i, o in enumerate(out) if o is None]
        for i, ids in zip(valid, self.tokenizer.encode([self.value(values[i]).prompt for i in valid])):
            out[i] = (
                InputError(f"prompt {ids}")
                if isinstance(ids, InputError)
                else [ids]
                if len(ids) <= bound
                else InputError(
                    f"prompt is {len(ids)} tokens with the template, over max_prompt_tokens={bound}",
                    bound="max_prompt_tokens",
                    limit=bound,
                )
            )
        return out

    def unpack(self, outputs: list[list], first: int, count: int, value: Any = None) -> list[dict[str, Any]]:
        """The prompt's possible candidates, best first: at most its beam width, or its `top`."""
        value = self.value(value)
        rows, ends, scores = (out[first] for out in outputs[:3])  # [W][new_tokens], [W], [W]
        keep = self._kept(scores, value)
        ids = [rows[j][: ends[j]] for j in keep]
        return [
            {"text": text, "token_ids": i, "score": scores[j]}
            for text, i, j in zip(self.tokenizer.decode_each(ids), ids, keep)
        ]

    def _kept(self, scores: list[float], value: BeamRequest) -> list[int]:
        count = min(value.beam_width or self.width, value.top or self.width)
        return [j for j in range(count) if scores[j] > IMPOSSIBLE]

    def body(self, answer: list[dict[str, Any]]) -> dict:
        return {"candidates": answer}

    def v2_inputs(self) -> list[Tensor]:
        return [
            Tensor("prompt", "BYTES", (1,)),
            *(Tensor(name, "INT32", (1,), optional=True) for name in ("beam_width", "new_tokens", "top")),
        ]

    def v2_outputs(self) -> list[Tensor]:
        """The candidates' fields, one tensor each, best first; token ids padded with -1 to the
        task's new tokens."""
        return [
            Tensor("text", "BYTES", (-1,), "candidates", "text"),
            Tensor("token_ids", "INT64", (-1, self.new_tokens), "candidates", "token_ids"),
            Tensor("score", "FP32", (-1,), "candidates", "score"),
        ]

    def outputs(self) -> list[str]:
        w, n = self.width, self.new_tokens
        return [f"tokens int64 [prompts, {w}, {n}]", f"lengths int64 [prompts, {w}]", f"scores float32 [prompts, {w}]"]

    def extra_inputs(self) -> list[str]:
        return [f"options int32 [prompts, {self.option_columns}]: beam width, new tokens"]

    def constants(self) -> dict:
        return {"stop_ids": self.stop_ids}  # a candidate ends at one of these

    def request_of(self, texts: list[str]) -> BeamRequest:
        return BeamRequest(texts[0])

    def difference(self, want: list[dict], got: list[dict]) -> Difference:
        scores = {tuple(c["token_ids"]): c["score"] for c in want}
        shared = [abs(c["score"] - scores[tuple(c["token_ids"])]) for c in got if tuple(c["token_ids"]) in scores]
        best_same = [c["token_ids"] for c in want[:1]] == [c["token_ids"] for c in got[:1]]
        return Difference(tuple(shared), len(shared) / max(1, len(want)), best_same)

    def gate(self, differences: list[Difference], max_diff: float, min_shared: float) -> dict[str, Any]:
        shares = [d.shared for d in differences]
        mean = sum(shares) / len(shares)
        return {
            "against": "bf16",
            "prompts": len(shares),
            "shared_candidates": mean,
            "worst_prompt": min(shares),
            "min_allowed": min_shared,
            "passes": mean >= min_shared,
        }

    def head_rows(self, value: Any) -> int:
        """The LM head's rows a request computes: the prompt's last row, then w per decode step."""
        value = self.value(value)
        return 1 + (value.beam_width or self.width) * ((value.new_tokens or self.new_tokens) - 1)

    def flops(self, model: ModelSpec, value: Any, precision: str) -> tuple[int, int]:
        (prompt,) = self.token_lengths(value)
        value = self.value(value)
        w, n = value.beam_width or self.width, value.new_tokens or self.new_tokens
        head_rows = self.head_rows(value)
        total = (
            flops.prefill_flops(model, [prompt])
            + flops.decode_flops(model, prompt, w, n)
            + flops.head_flops(model, head_rows, model.vocab_size)
        )
        fp8 = (
            flops.static_fp8_flops(model, prompt + w * (n - 1), skipped=prompt - 1) if precision == "fp8-static" else 0
        )
        return total, fp8
