"""The Python API: a checkpoint and a task, or a built package, -> an engine to ask.

eng = Engine.from_checkpoint("ckpt-dir-or.gguf", task="task.yaml", device="cpu")
eng.score(["text a", "text b"])  # [[p_label0, p_label1, ...], ...]
eng.embed(["text a", "text b"])  # float32 array [texts, dims]: a head: embedding task
eng.beam("a prompt")             # [{"text", "token_ids", "score"}, ...] best first
eng.beam("a prompt", beam_width=10, top=3, exclude=["sku-1"])   # a request's settings; catalog
                                 # tasks answer each candidate's item "id" too
eng = Engine.from_package("unpacked-archive-dir")   # the compiled graph, as a worker serves it
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from slm_core.compile.checkpoint import load_checkpoint
from slm_core.compile.eager import eager_engine
from slm_core.serve.loader import load_package
from slm_core.serve.runtime import Runtime
from slm_core.spec import RuntimeSpec, TaskSpec


class Engine(Runtime):
    """The runtime with the Python API of its task's kind."""

    def score(self, texts: list[str]) -> list[list[float]]:
        """One row per text over the task's labels, in their order (probabilities, or logits)."""
        self._check("score")
        return self.run_one(texts)

    def embed(self, texts: list[str]) -> np.ndarray:
        """One embedding per text, in order, as a [texts, dims] float32 array: its last token's
        hidden state after the final norm, cut to the task's dims and L2-normalised if the task
        says so."""
        self._check("embed")
        return self.run_one(texts)

    def beam(self, prompt: str, **settings: Any) -> list[dict[str, Any]]:
        """The candidates, best first: text, token ids (the stop token included), log-probability,
        and for a catalog task the item's id. `settings` are the request's optional fields
        (beam_width, new_tokens, top; exclude for a catalog task), refused as a REST request's are."""
        self._check("beam")
        answer = self.run_one(self.task.request({self.task.field: prompt, **settings}))
        return answer["candidates"] if isinstance(answer, dict) else answer

    def _check(self, method: str) -> None:
        if self.task.api != method:
            raise TypeError(f"this engine runs a {self.task.api!r} task: call engine.{self.task.api}(...)")

    @classmethod
    def from_checkpoint(
        cls, path: "str | Path", task: "str | Path | Mapping[str, Any] | TaskSpec", device: str = "cpu"
    ) -> "Engine":
        """The task's eager graph over the checkpoint, on `device` with its kernels (Triton on CUDA)."""
        return eager_engine(load_checkpoint(path), TaskSpec.load(task), RuntimeSpec(device), cls)

    @classmethod
    def from_package(cls, model_dir: "str | Path", gpu_id: int | None = None, headroom: float = 0.0) -> "Engine":
        """A built package (an unpacked archive), loaded as a worker loads it; `headroom`: room for
        a catalog swapped in later (swap) without new buffers, as a share of each of its sizes."""
        return load_package(model_dir, gpu_id, engine=cls, headroom=headroom)
