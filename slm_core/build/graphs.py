"""The request graphs, one per task kind's `graph` name (GRAPHS). Each is one nn.Module whose
forward is a whole request: fixed loops, no host syncs, no data-dependent Python control flow, so
torch.export captures it as one graph. The model is built by the caller and handed in.
"""

from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from slm_core.build.checkpoint import Checkpoint, classifier_head
from slm_core.build.model import Transformer
from slm_core.errors import SpecError
from slm_core.spec import RuntimeSpec, TaskSpec

NEG = -1.0e9  # transformers' "impossible" score: keeps its ordering of exhausted candidates


class LastTokenGraph(nn.Module):
    """Packed texts -> one row per text from its last token's hidden state after the final norm:
    a linear head [n_labels, hidden] (+ bias), then softmax (or the logits as they are)."""

    lm_head: ClassVar[bool] = True  # whether the graph reads the checkpoint's LM head

    def __init__(self, model: Transformer, head_weight: torch.Tensor, head_bias: torch.Tensor | None = None,
                 logits: bool = False):
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


class BeamGraph(nn.Module):
    """B prompts -> W candidates each of up to N new tokens, as transformers' beam search
    (early_stopping=True, length_penalty=0) ranks them, prompt by prompt.

    Each step expands a prompt's running beams and takes its top 2W; candidates that end (stop
    token, or the last step) among the top W go to the prompt's finished pool of W, the rest
    refill its W running beams. The prompts are packed like score texts: prefill runs once over
    all of them, and each decode step runs the B×W beams together.
    """

    lm_head: ClassVar[bool] = True

    def __init__(self, model: Transformer, beam_width: int, new_tokens: int, stop_ids: list[int], pad_id: int,
                 topk=None):
        super().__init__()
        self.topk = topk  # kernels.vocab_topk.vocab_topk, or None for torch.topk + torch.logsumexp
        if 2 * beam_width > model.spec.vocab_size:
            raise SpecError(f"beam_width={beam_width} needs 2 * beam_width <= vocab size {model.spec.vocab_size}")
        self.model = model
        self.width = beam_width
        self.new_tokens = new_tokens
        self.pad_id = pad_id
        self.register_buffer("stop_ids", torch.tensor(stop_ids, dtype=torch.int64), persistent=False)
        # Only the top W of the 2W candidates may finish in a step (the rest are backups).
        self.register_buffer("top_w", torch.arange(2 * beam_width) < beam_width, persistent=False)

    @classmethod
    def resolve(cls, spec: TaskSpec, ckpt: Checkpoint) -> TaskSpec:
        return spec

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "BeamGraph":
        topk = None
        if runtime.kernels == "triton":
            from kernels.vocab_topk import vocab_topk as topk
        stop = task.stop_ids
        return cls(model, task.width, task.new_tokens, stop, pad_id=stop[0] if stop else 0, topk=topk)

    def _expand(self, logits: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """logits: [B*K, V], the K running beams of each prompt; cum: [B, K] fp32. Per prompt, the
        top 2W of its K×2W continuations: scores [B, 2W] fp32 (sorted), parent beam [B, 2W] (of K),
        token [B, 2W]."""
        b, beams = cum.shape
        k = 2 * self.width
        # Per beam its top 2W logits (in the model dtype, in any order) and their FP32
        # log-probabilities: log_softmax(x)[i] = x[i] - logsumexp(x), without writing the
        # [B*K, V] fp32 log_softmax.
        if self.topk is not None:
            top_logits, top_ids, lse = self.topk(logits, k)
            lse = lse[:, None]
        else:
            top_logits, top_ids = logits.topk(k, dim=-1, sorted=False)  # the next topk orders them
            lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        log_probs = top_logits.float() - lse
        scores, flat = (log_probs.view(b, beams, k) + cum[:, :, None]).flatten(1).topk(k, dim=1)
        return scores, flat // k, top_ids.view(b, beams * k).gather(1, flat)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """input_ids: [T] int32, B prompts packed; cu_seqlens: [B+1] int32. Returns per prompt,
        best first: tokens [B, W, N] int64 (pad after the end), lengths [B, W] int64, scores [B, W]
        fp32 (cumulative log-probabilities)."""
        w, n, dev = self.width, self.new_tokens, input_ids.device
        b = cu_seqlens.shape[0] - 1
        hidden, prefix = self.model.prefill(input_ids, cu_seqlens)  # prompt K/V: once, [T, Hkv, D] per layer
        logits = self.model.logits(hidden)  # [B, V]: each prompt's last token
        prompt_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[:, None].expand(b, w).reshape(-1)  # [B*W]

        history = torch.zeros(b, 1, 0, dtype=torch.int64, device=dev)  # running beams' tokens [B, K, step-1]
        cum = torch.zeros(b, 1, dtype=torch.float32, device=dev)
        suffix = None  # per layer [B*W, step-1, Hkv, D] from the first decode on
        pool_tokens = torch.full((b, w, n), self.pad_id, dtype=torch.int64, device=dev)
        pool_lengths = torch.zeros(b, w, dtype=torch.int64, device=dev)
        pool_scores = torch.full((b, w), NEG, dtype=torch.float32, device=dev)
        pool_done = torch.zeros(b, w, dtype=torch.bool, device=dev)

        for step in range(1, n + 1):  # `step` tokens generated after this iteration
            if step > 1:
                last = history[:, :, -1].reshape(-1)  # [B*W]
                hidden, suffix = self.model.decode(last, prompt_len + (step - 2), prefix, cu_seqlens, suffix)
                logits = self.model.logits(hidden)  # [B*W, V]
            scores, parent, token = self._expand(logits, cum)  # [B, 2W] each
            candidates = torch.cat([take(history, parent), token[:, :, None]], dim=2)  # [B, 2W, step]
            ends = torch.isin(token, self.stop_ids)
            if step == n:
                ends = torch.ones_like(ends)

            # Finished pool: merge candidates that end within the top W, keep the best W. Once a
            # prompt's pool holds W finished candidates nothing enters it any more (early_stopping=True).
            entering = scores + (~(ends & self.top_w)).float() * NEG + pool_done.all(1, keepdim=True).float() * NEG
            merged = torch.cat([pool_scores, entering], dim=1)  # [B, 3W]
            keep = merged.topk(w, dim=1).indices
            padded = F.pad(candidates, (0, n - step), value=self.pad_id)
            pool_tokens = take(torch.cat([pool_tokens, padded], dim=1), keep)
            pool_lengths = take(torch.cat([pool_lengths, torch.full_like(token, step)], dim=1), keep)
            pool_scores = take(merged, keep)
            pool_done = take(torch.cat([pool_done, ends & self.top_w], dim=1), keep)

            if step < n:  # running beams: the best W that did not end; reorder history and suffix K/V only
                cum, keep = (scores + ends.float() * NEG).topk(w, dim=1)
                history = take(candidates, keep)
                if suffix is not None:
                    rows = (take(parent, keep) + torch.arange(b, device=dev)[:, None] * w).flatten()
                    suffix = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in suffix]
        return pool_tokens, pool_lengths, pool_scores


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per prompt, rows of x by index: x [B, K, ...], idx [B, J] into K -> [B, J, ...]."""
    b, k = x.shape[0], x.shape[1]
    flat = (idx + torch.arange(b, device=idx.device)[:, None] * k).flatten()
    return x.flatten(0, 1).index_select(0, flat).view(b, idx.shape[1], *x.shape[2:])


GRAPHS: dict[str, type[nn.Module]] = {"labels": LabelsGraph, "classifier": ClassifierGraph, "beam": BeamGraph}
