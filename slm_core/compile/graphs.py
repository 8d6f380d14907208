"""The request graphs, one per task kind's `graph` name (GRAPHS). Each is one nn.Module whose
forward is a whole request: fixed loops, no host syncs, no data-dependent Python control flow, so
torch.export captures it as one graph. The model is built by the caller and handed in.
"""

from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from slm_core.compile.beam_graph import BeamGraph
from slm_core.compile.catalog_graph import CatalogGraph
from slm_core.compile.checkpoint import Checkpoint, classifier_head
from slm_core.compile.mlp_head import ACTIVATIONS, MlpHead, read_mlp
from slm_core.compile.model import Transformer
from slm_core.errors import SpecError
from slm_core.spec import RuntimeSpec, TaskSpec


class LastTokenGraph(nn.Module):
    """Packed texts -> one row per text from its last token's hidden state after the final norm:
    a linear head [n_labels, hidden] (+ bias), then softmax (or the logits as they are)."""

    lm_head: ClassVar[bool] = True  # whether the graph reads the checkpoint's LM head

    def __init__(
        self, model: Transformer, head_weight: torch.Tensor, head_bias: torch.Tensor | None = None, logits: bool = False
    ):
        super().__init__()
        self.model = model
        self.register_buffer("head_weight", head_weight.detach().clone())  # [n_labels, hidden]
        self.register_buffer("head_bias", None if head_bias is None else head_bias.detach().clone())
        self.logits = logits

    @classmethod
    def resolve(cls, spec: TaskSpec, ckpt: Checkpoint) -> TaskSpec:
        """The task as this checkpoint serves it."""
        return spec

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int32 packed; cu_seqlens: [N+1] int32. Returns [N, n_labels] fp32."""
        hidden, _ = self.model.prefill(input_ids, cu_seqlens)
        last = self.model.norm(hidden)  # [N, hidden]: each text's last token
        row = F.linear(last.to(self.head_weight.dtype), self.head_weight, self.head_bias).float()
        return row if self.logits else torch.softmax(row, dim=-1)


class LabelsGraph(LastTokenGraph):
    """The head is the LM head's rows of the label tokens (only those are ever computed), in the
    model dtype."""

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "LabelsGraph":
        return cls(model, model.lm_head.weight.detach()[task.label_ids], logits=task.spec.output == "logits")


class ClassifierGraph(LastTokenGraph):
    """The head is a `*ForSequenceClassification` checkpoint's `score` layer, in FP32."""

    lm_head = False

    @classmethod
    def resolve(cls, spec: TaskSpec, ckpt: Checkpoint) -> TaskSpec:
        """The label names: the task's, else the checkpoint's id2label."""
        return replace(spec, labels=classifier_head(ckpt, spec.labels)[2])

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "ClassifierGraph":
        weight, bias, _ = classifier_head(ckpt, task.spec.labels)
        return cls(model, weight.float(), None if bias is None else bias.float(), task.spec.output == "logits")


class EmbeddingGraph(nn.Module):
    """Packed texts -> each text's last-token hidden state after the final norm, in FP32: its
    first `dims` dimensions, L2-normalised if the task says so."""

    lm_head: ClassVar[bool] = False

    def __init__(self, model: Transformer, dims: int, normalize: bool):
        super().__init__()
        self.model = model
        self.dims = dims
        self.normalize = normalize

    @classmethod
    def resolve(cls, spec: TaskSpec, ckpt: Checkpoint) -> TaskSpec:
        """dims: the task's, at most the model's hidden size, else all of them."""
        hidden = ckpt.spec.hidden_size
        if spec.dims is not None and spec.dims > hidden:
            raise SpecError(f"task key 'dims' is {spec.dims}, over the model's hidden size {hidden}")
        return replace(spec, dims=spec.dims or hidden)

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "EmbeddingGraph":
        return cls(model, task.dims, task.spec.normalize)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int32 packed; cu_seqlens: [N+1] int32. Returns [N, dims] fp32."""
        hidden, _ = self.model.prefill(input_ids, cu_seqlens)
        out = self.model.norm(hidden)[:, : self.dims].float()  # [N, dims]: each text's last token
        return F.normalize(out, dim=-1) if self.normalize else out


class MlpGraph(EmbeddingGraph):
    """The embedding, then the user's MLP (slm_core.compile.mlp_head) in FP32: softmax over its
    output row, or the row itself."""

    def __init__(self, model: Transformer, dims: int, normalize: bool, head: MlpHead, logits: bool):
        super().__init__(model, dims, normalize)
        self.layers = len(head.weights)
        for i, (weight, bias) in enumerate(zip(head.weights, head.biases)):
            self.register_buffer(f"weight{i}", weight.clone())
            self.register_buffer(f"bias{i}", None if bias is None else bias.clone())
        self.activation = ACTIVATIONS[head.activation]
        self.logits = logits

    @classmethod
    def resolve(cls, spec: TaskSpec, ckpt: Checkpoint) -> TaskSpec:
        """dims as an embedding's; the output names: the task's, else the file's, else LABEL_i."""
        spec = super().resolve(spec, ckpt)
        if spec.mlp is None:
            raise SpecError("head: mlp needs the task key 'mlp': the safetensors file of the MLP")
        head = read_mlp(spec.mlp, spec.dims)
        labels = spec.labels or head.labels or tuple(f"LABEL_{i}" for i in range(head.outputs))
        if len(labels) != head.outputs:
            raise SpecError(f"the task names {len(labels)} labels, but the MLP has {head.outputs} outputs")
        return replace(spec, labels=tuple(labels))

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "MlpGraph":
        spec = task.spec
        return cls(model, spec.dims, spec.normalize, read_mlp(spec.mlp, spec.dims), spec.output == "logits")

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int32 packed; cu_seqlens: [N+1] int32. Returns [N, outputs] fp32."""
        x = super().forward(input_ids, cu_seqlens)
        for i in range(self.layers):
            x = F.linear(x, getattr(self, f"weight{i}"), getattr(self, f"bias{i}"))
            if i < self.layers - 1:
                x = self.activation(x)
        return x if self.logits else torch.softmax(x, dim=-1)


GRAPHS: dict[str, type[nn.Module]] = {
    "labels": LabelsGraph,
    "classifier": ClassifierGraph,
    "beam": BeamGraph,
    "catalog": CatalogGraph,
    "embedding": EmbeddingGraph,
    "mlp": MlpGraph,
}
