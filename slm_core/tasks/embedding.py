"""Score with no head: per text, its embedding, the last token's hidden state after the final norm
in FP32, cut to its first `dims` dimensions (Matryoshka-style; all of them by default) and
L2-normalised if `normalize`. The prefill is the score tasks' own; no LM head row is computed
(TextsTask.flops counts a head of no labels: the prefill alone)."""

import math
from typing import Any, ClassVar

import numpy as np

from slm_core.errors import SpecError
from slm_core.tasks.base import Difference, Tensor
from slm_core.tasks.texts import TextsTask


class EmbeddingTask(TextsTask):
    head = "embedding"
    graph = "embedding"
    api = "embed"
    answer = ("embeddings",)
    # judged per text by its cosine distance to the other answer (1 - cos), whatever the scale
    tolerance: ClassVar[dict[str, float]] = {"fp32": 1e-6, "bf16": 5e-3, "fp8-static": 5e-3}

    def check_head(self, spec) -> None:
        if spec.labels:
            raise SpecError("an embedding task has no 'labels'")

    @property
    def labels(self) -> list[str]:
        return []

    @property
    def dims(self) -> int | None:
        """The embedding's dimensions; None before the build resolves it from the checkpoint
        (EmbeddingGraph.resolve: all of the hidden state unless the task cuts it)."""
        return self.spec.dims

    def host(self, output) -> np.ndarray:
        """The [texts, dims] float32 rows as they are: no Python float per value (15,360 for a W1
        request of Qwen3-0.6B). The REST answer writes each value as the shortest decimal that
        reads back as the same float32, 10 characters where a float64 needs 19."""
        return output.numpy()

    def body(self, answer: np.ndarray) -> dict:
        return {"embeddings": answer}

    def v2_outputs(self) -> list[Tensor]:
        return [Tensor("embeddings", "FP32", (-1, self.dims or -1))]

    def outputs(self) -> list[str]:
        return [
            f"embeddings float32 [texts, {self.dims or 'hidden'}]" + (" L2-normalised" if self.spec.normalize else "")
        ]

    def constants(self) -> dict:
        return {"dims": self.dims, "normalize": self.spec.normalize}

    def difference(self, want: list[list[float]], got: list[list[float]]) -> Difference:
        return Difference(tuple(cosine_distance(a, b) for a, b in zip(want, got)))

    def gate(self, differences: list[Difference], max_diff: float, min_shared: float) -> dict[str, Any]:
        values = [v for d in differences for v in d.values]
        worst = max(values)
        return {
            "against": "bf16",
            "texts": len(values),
            "max_cosine_distance": worst,
            "mean_cosine_distance": sum(values) / len(values),
            "max_allowed": max_diff,
            "passes": worst <= max_diff,
        }


def cosine_distance(a, b) -> float:
    """1 - cos(a, b) of two vectors (lists or arrays), in float64; 0 for two zero vectors, 1 for one."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = math.sqrt(float(a @ a) * float(b @ b))
    return 1.0 - float(a @ b) / norms if norms > 0 else float(bool(a.any() or b.any()))
