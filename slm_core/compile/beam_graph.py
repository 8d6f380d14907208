"""The beam search graph: B prompts -> up to W candidates each of up to N new tokens, as
transformers' beam search (early_stopping=True, length_penalty=0) ranks them, prompt by prompt.

Each step expands a prompt's running beams and takes its top 2W; candidates that end (stop
token, or the prompt's last step) among the top W go to the prompt's finished pool, the rest
refill its running beams. The prompts are packed like score texts: prefill runs once over all of
them, and each decode step runs the B×W beams together.

W and N are bounds: each prompt's row of `options` holds its own width w <= W and new tokens
n <= N, and the search is the one transformers runs with num_beams=w, max_new_tokens=n. Beams past
w hold -inf (they take part in nothing), only the top 2w candidates exist, the top w may finish,
the pool is full at w finished, and nothing enters it after step n.

How a step expands beams is the subclass's (`expand`): here the whole vocabulary's top 2W per
beam; slm_core.compile.catalog_graph the children of each beam's trie node.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from slm_core.compile.checkpoint import Checkpoint
from slm_core.compile.model import Transformer
from slm_core.errors import SpecError
from slm_core.spec import RuntimeSpec

NEG = -1.0e9  # transformers' "impossible" score: keeps its ordering of exhausted candidates
INF = float("inf")


class BeamGraph(nn.Module):
    lm_head: ClassVar[bool] = True

    def __init__(
        self, model: Transformer, beam_width: int, new_tokens: int, stop_ids: list[int], pad_id: int, topk=None
    ):
        super().__init__()
        self.topk = topk  # slm_kernels.vocab_topk.vocab_topk, or None for torch.topk + torch.logsumexp
        if 2 * beam_width > model.spec.vocab_size:
            raise SpecError(f"beam_width={beam_width} needs 2 * beam_width <= vocab size {model.spec.vocab_size}")
        self.model = model
        self.width = beam_width
        self.new_tokens = new_tokens
        self.pad_id = pad_id
        self.register_buffer("stop_ids", torch.tensor(stop_ids, dtype=torch.int64), persistent=False)

    @classmethod
    def resolve(cls, spec, ckpt: Checkpoint):
        return spec

    @classmethod
    def build(cls, task, model: Transformer, ckpt: Checkpoint, runtime: RuntimeSpec) -> "BeamGraph":
        topk = None
        if runtime.kernels == "triton":
            from slm_kernels.vocab_topk import vocab_topk as topk
        stop = task.stop_ids
        return cls(
            model, task.width, task.new_tokens, stop, pad_id=stop[0] if stop else 0, topk=topk, **cls.options(task)
        )

    @classmethod
    def options(cls, task) -> dict:
        """Constructor arguments of a subclass, from the task."""
        return {}

    # --- what a subclass changes ------------------------------------------------------------------
    def start(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per prompt, the first beam's search state ([B, 1] tensors) beside its tokens."""
        return ()

    def head(self, constants: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """What `logits` needs of the constants, computed once per call."""
        return None

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
        return self.model.logits(hidden)

    def expand(
        self,
        logits: torch.Tensor,
        cum: torch.Tensor,
        state: tuple[torch.Tensor, ...],
        step: int,
        options: torch.Tensor,
        constants: tuple[torch.Tensor, ...],
    ) -> tuple:
        """logits: [B*K, V], the K running beams of each prompt; cum: [B, K] fp32. Per prompt, the
        top 2W of its continuations, in any order: scores [B, 2W] fp32, each one's place among them
        [B, 2W] (0: the best, as `top`), parent beam [B, 2W] (of K), token [B, 2W], whether it ends
        on a stop token [B, 2W], its search state (tensors [B, 2W]) and the item it completes
        ([B, 2W], or None)."""
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
        scores, flat, place = top((log_probs.view(b, beams, k) + cum[:, :, None]).flatten(1), k)
        token = top_ids.view(b, beams * k).gather(1, flat)
        return scores, place, flat // k, token, torch.isin(token, self.stop_ids), (), None

    # --- the search ---------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, options: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """input_ids: [T] int32, B prompts packed; cu_seqlens: [B+1] int32; options: [B, 2] int32,
        each prompt's beam width and new tokens. Returns per prompt, best first: tokens [B, W, N]
        int64 (pad after the end), lengths [B, W] int64, scores [B, W] fp32 (cumulative
        log-probabilities; below -1e8 where the prompt has fewer candidates)."""
        return self.search(input_ids, cu_seqlens, options, ())[:3]

    def search(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        options: torch.Tensor,
        constants: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        """forward's outputs and the item of each pool candidate [B, W] (-1 without items)."""
        w, n, dev = self.width, self.new_tokens, input_ids.device
        b = cu_seqlens.shape[0] - 1
        width, limit = options[:, 0:1].long(), options[:, 1:2].long()  # [B, 1] each
        slot = torch.arange(w, device=dev)[None, :]
        head = self.head(constants)
        hidden, prefix = self.model.prefill(input_ids, cu_seqlens)  # prompt K/V: once, [T, Hkv, D] per layer
        logits = self.logits(hidden, head)  # [B, V]: each prompt's last token
        prompt_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[:, None].expand(b, w).reshape(-1)  # [B*W]

        history = torch.zeros(b, 1, 0, dtype=torch.int64, device=dev)  # running beams' tokens [B, K, step-1]
        cum = torch.zeros(b, 1, dtype=torch.float32, device=dev)
        state = self.start(b, dev)
        suffix = None  # per layer [B*W, step-1, Hkv, D] from the first decode on
        pool_tokens = torch.full((b, w, n), self.pad_id, dtype=torch.int64, device=dev)
        pool_lengths = torch.zeros(b, w, dtype=torch.int64, device=dev)
        pool_scores = torch.full((b, w), NEG, dtype=torch.float32, device=dev)
        pool_done = torch.zeros(b, w, dtype=torch.bool, device=dev)
        pool_items = torch.full((b, w), -1, dtype=torch.int64, device=dev)

        for step in range(1, n + 1):  # `step` tokens generated after this iteration
            if step > 1:
                last = history[:, :, -1].reshape(-1)  # [B*W]
                hidden, suffix = self.model.decode(last, prompt_len + (step - 2), prefix, cu_seqlens, suffix)
                logits = self.logits(hidden, head)  # [B*W, V]
            scores, place, parent, token, stopped, grown, item = self.expand(
                logits, cum, state, step, options, constants
            )
            scores = torch.where(place < 2 * width, scores, -INF)  # a width-w search has 2w candidates
            candidates = torch.cat([take(history, parent), token[:, :, None]], dim=2)  # [B, 2W, step]
            ends = torch.ones_like(stopped) if step == n else stopped | (limit == step)

            # Finished pool: merge candidates that end within the top w, keep the best. Once a
            # prompt's pool holds w finished candidates nothing enters it any more (early_stopping=True).
            finishing = ends & (place < width) & (limit >= step)
            full = (pool_done | (slot >= width)).all(1, keepdim=True)
            entering = scores + (~finishing).float() * NEG + full.float() * NEG
            merged = torch.cat([pool_scores, entering], dim=1)  # [B, 3W]
            keep = merged.topk(w, dim=1).indices
            padded = F.pad(candidates, (0, n - step), value=self.pad_id)
            pool_tokens = take(torch.cat([pool_tokens, padded], dim=1), keep)
            pool_lengths = take(torch.cat([pool_lengths, torch.full_like(token, step)], dim=1), keep)
            pool_scores = take(merged, keep)
            pool_done = take(torch.cat([pool_done, finishing], dim=1), keep)
            if item is not None:
                pool_items = take(torch.cat([pool_items, item], dim=1), keep)

            if step < n:  # running beams: the best w that did not end; reorder history, state and suffix K/V only
                cum, keep, place = top(scores + ends.float() * NEG, w)
                cum = torch.where(place < width, cum, -INF)
                history = take(candidates, keep)
                state = tuple(take(s, keep) for s in grown)
                if suffix is not None:
                    rows = (take(parent, keep) + torch.arange(b, device=dev)[:, None] * w).flatten()
                    suffix = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in suffix]
        return pool_tokens, pool_lengths, pool_scores, pool_items


def top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=1) of a [B, M] tensor in any order, and each one's place among them (0: the
    best; equal values by index). The search needs only places: torch.topk(sorted=True) orders its
    k with a one-block radix sort, slow at k = 2W, where comparing the k with each other is one
    small [B, k, k] reduction."""
    values, idx = x.topk(k, dim=1, sorted=False)
    return values, idx, places(values, idx)


def places(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each of a row's values' place among them [B, k] (0: the best; equal values by idx): how many
    values beat it."""
    above, tied = values[:, None, :] > values[:, :, None], values[:, None, :] == values[:, :, None]
    return (above | (tied & (idx[:, None, :] < idx[:, :, None]))).sum(2)


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per prompt, rows of x by index: x [B, K, ...], idx [B, J] into K -> [B, J, ...]."""
    b, k = x.shape[0], x.shape[1]
    flat = (idx + torch.arange(b, device=idx.device)[:, None] * k).flatten()
    return x.flatten(0, 1).index_select(0, flat).view(b, idx.shape[1], *x.shape[2:])
