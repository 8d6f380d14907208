"""What the score tasks share: a request of up to max_texts texts, packed one after another into
one prefill, answered with one row of numbers per text, in order."""

from typing import Any, ClassVar

from slm_core import flops
from slm_core.errors import InputError, SpecError, json_type
from slm_core.spec import ModelSpec
from slm_core.tasks.base import Difference, Task, Tensor


class TextsTask(Task):
    kind = "score"
    api = "score"
    field = "texts"
    placeholder = "{text}"
    answer = ("labels", "scores")
    pad_sequences = True  # a padding text costs only its few rows of the prefill
    # The best-served call size on the H200, split by two workers (bench/RESULTS.md).
    cuda_max_batch = 4
    # A probability of the label rows; the check fails past these.
    tolerance: ClassVar[dict[str, float]] = {"fp32": 1e-4, "bf16": 5e-2, "fp8-static": 5e-2}

    def __init__(self, spec, tokenizer):
        super().__init__(spec, tokenizer)
        if spec.catalog is not None:
            raise SpecError("task key 'catalog' is for beam tasks")
        self.check_head(spec)

    def check_head(self, spec) -> None:
        """The keys of the row a text gets: its labels and output."""
        self.check_output(spec)
        if len(spec.labels) < 2:  # a classifier's come from its checkpoint (ClassifierGraph.resolve)
            raise SpecError("a score task needs at least two 'labels'")
        if spec.dims is not None or spec.normalize:
            raise SpecError("task keys 'dims' and 'normalize' are for head: embedding or mlp")
        if spec.mlp is not None:
            raise SpecError("task key 'mlp' is for head: mlp")

    @staticmethod
    def check_output(spec) -> None:
        if spec.output not in ("probs", "logits"):
            raise SpecError(f"task key 'output' must be 'probs' or 'logits', got {spec.output!r}")

    @property
    def request_sequences(self) -> int:
        return self.spec.max_texts

    @property
    def sequence_tokens(self) -> int:
        return self.spec.max_text_tokens

    @property
    def labels(self) -> list[str]:
        return list(self.spec.labels)

    def encode(self, values: list[Any]) -> "list[list[list[int]] | InputError]":
        out: list = [self._refusal(texts) for texts in values]
        valid = [texts for texts, refused in zip(values, out) if refused is None]
        encoded = iter(self.tokenizer.encode([text for texts in valid for text in texts]))
        for i, texts in enumerate(values):
            if out[i] is None:
                out[i] = self._within_bounds([next(encoded) for _ in texts])
        return out

    def _within_bounds(self, ids: list) -> "list[list[int]] | InputError":
        """A request's ids, or the InputError of its first text the tokenizer refused or that is
        over the token bound."""
        bound = self.spec.max_text_tokens
        for j, seq in enumerate(ids):
            if isinstance(seq, InputError):
                return InputError(f"texts[{j}] {seq}")
            if len(seq) > bound:
                return InputError(
                    f"texts[{j}] is {len(seq)} tokens with the template, over max_text_tokens={bound}",
                    bound="max_text_tokens",
                    limit=bound,
                )
        return ids

    def _refusal(self, texts: Any) -> InputError | None:
        try:
            self._check(texts)
        except InputError as e:
            return e
        return None

    def _check(self, texts: Any) -> None:
        n = self.spec.max_texts
        if not isinstance(texts, (list, tuple)):  # a tuple: from the Python API
            raise InputError(f"'texts' must be an array of strings, got {json_type(texts)}")
        if not texts:
            raise InputError(f"'texts' is empty; send 1 to {n} texts (max_texts)", bound="max_texts", limit=n)
        if len(texts) > n:
            raise InputError(f"{len(texts)} texts exceed max_texts={n}", bound="max_texts", limit=n)
        for i, text in enumerate(texts):
            self.tokenizer.check(text, f"texts[{i}]", "max_text_tokens", self.spec.max_text_tokens)

    def unpack(self, outputs: list[list], first: int, count: int, value: Any = None) -> list[list[float]]:
        return outputs[0][first : first + count]  # [texts][labels]

    def body(self, answer: list[list[float]]) -> dict:
        return {"labels": self.labels, "scores": answer}

    def v2_inputs(self) -> list[Tensor]:
        return [Tensor("texts", "BYTES", (-1,))]

    def v2_outputs(self) -> list[Tensor]:
        return [Tensor("labels", "BYTES", (len(self.labels),)), Tensor("scores", "FP32", (-1, len(self.labels)))]

    def outputs(self) -> list[str]:
        return [f"{self.spec.output} float32 [texts, {len(self.labels)}]"]

    def request_of(self, texts: list[str]) -> list[str]:
        return list(texts[: self.spec.max_texts])

    def difference(self, want: list[list[float]], got: list[list[float]]) -> Difference:
        return Difference(tuple(abs(x - y) for a, b in zip(want, got) for x, y in zip(a, b)))

    def gate(self, differences: list[Difference], max_diff: float, min_shared: float) -> dict[str, Any]:
        values = [v for d in differences for v in d.values]
        worst = max(values)
        return {
            "against": "bf16",
            "texts": len(values) // len(self.labels),
            "max_abs_diff": worst,
            "mean_abs_diff": sum(values) / len(values),
            "max_allowed": max_diff,
            "passes": worst <= max_diff,
        }

    def flops(self, model: ModelSpec, value: Any, precision: str) -> tuple[int, int]:
        lengths = self.token_lengths(value)
        total = flops.prefill_flops(model, lengths) + flops.head_flops(model, len(lengths), len(self.labels))
        tokens = sum(lengths)
        fp8 = flops.static_fp8_flops(model, tokens, skipped=tokens - len(lengths)) if precision == "fp8-static" else 0
        return total, fp8
