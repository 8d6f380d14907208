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

from typing import ClassVar, NamedTuple

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
        self,
        model: Transformer,
        beam_width: int,
        new_tokens: int,
        stop_ids: list[int],
        pad_id: int,
        topk=None,
        row_topk=None,
    ):
        super().__init__()
        self.topk = topk  # slm_kernels.vocab_topk.vocab_topk, or None for torch.topk + torch.logsumexp
        self.row_topk = row_topk  # slm_kernels.row_topk.row_topk, or None for torch.topk
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
        topk = row_topk = None
        if runtime.kernels == "triton":
            from slm_kernels.row_topk import row_topk
            from slm_kernels.vocab_topk import vocab_topk as topk
        stop = task.stop_ids
        pad_id = stop[0] if stop else 0
        return cls(model, task.width, task.new_tokens, stop, pad_id, topk=topk, row_topk=row_topk, **cls.options(task))

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
        scores, flat, place = top((log_probs.view(b, beams, k) + cum[:, :, None]).flatten(1), k, self.row_topk)
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
        """forward's outputs and the item of each pool candidate [B, W] (-1 without items): the
        prompts' prefill, then per new token a decode step of the running beams (after the
        first), the selection of their continuations, the finished pool's merge, and the running
        beams that go on."""
        limits = options[:, 0:1].long(), options[:, 1:2].long()  # width and new tokens, [B, 1] each
        head = self.head(constants)
        logits, prompt = self.prefill(input_ids, cu_seqlens, head)
        b, dev = cu_seqlens.shape[0] - 1, input_ids.device
        beams = Beams(
            torch.zeros(b, 1, 0, dtype=torch.int64, device=dev),
            torch.zeros(b, 1, dtype=torch.float32, device=dev),
            self.start(b, dev),
            None,
        )
        pool = self.empty_pool(b, dev)
        for step in range(1, self.new_tokens + 1):  # `step` tokens generated after this iteration
            if step > 1:
                logits, beams = self.step(beams, prompt, step, head)
            chosen = self.select(logits, beams, step, limits, options, constants)
            pool = self.finish(pool, chosen, step, limits)
            if step < self.new_tokens:
                beams = self.advance(beams, chosen, limits[0])
        return pool.tokens, pool.lengths, pool.scores, pool.items

    # --- the stages of the search ---------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, head) -> tuple[torch.Tensor, "Prompt"]:
        """The prompts once: each one's last-token logits [B, V] and what every decode step reads
        of them (their K/V, [T, Hkv, D] per layer, stored once for all beams)."""
        hidden, prefix = self.model.prefill(input_ids, cu_seqlens)
        b = cu_seqlens.shape[0] - 1
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[:, None].expand(b, self.width).reshape(-1)  # [B*W]
        return self.logits(hidden, head), Prompt(prefix, cu_seqlens, lengths)

    def step(self, beams: "Beams", prompt: "Prompt", step: int, head) -> tuple[torch.Tensor, "Beams"]:
        """One token for every running beam: its last token through the decoder over the prompt's
        K/V and its own suffix. Returns the logits [B*W, V] and the beams with their suffix grown."""
        last = beams.history[:, :, -1].reshape(-1)  # [B*W]
        positions = prompt.lengths + (step - 2)
        hidden, suffix = self.model.decode(last, positions, prompt.kv, prompt.cu_seqlens, beams.suffix)
        return self.logits(hidden, head), beams._replace(suffix=suffix)

    def select(self, logits, beams: "Beams", step: int, limits, options, constants) -> "Chosen":
        """Per prompt the top 2w continuations of its running beams (expand), with the tokens
        each would hold and whether it ends: on a stop token, at the prompt's own last step or
        at the last step of all."""
        width, limit = limits
        scores, place, parent, token, stopped, grown, item = self.expand(
            logits, beams.cum, beams.state, step, options, constants
        )
        scores = torch.where(place < 2 * width, scores, -INF)  # a width-w search has 2w candidates
        candidates = torch.cat([take(beams.history, parent), token[:, :, None]], dim=2)  # [B, 2W, step]
        ends = torch.ones_like(stopped) if step == self.new_tokens else stopped | (limit == step)
        return Chosen(scores, place, parent, candidates, ends, grown, item)

    def empty_pool(self, b: int, device: torch.device) -> "Pool":
        w, n = self.width, self.new_tokens
        return Pool(
            torch.full((b, w, n), self.pad_id, dtype=torch.int64, device=device),
            torch.zeros(b, w, dtype=torch.int64, device=device),
            torch.full((b, w), NEG, dtype=torch.float32, device=device),
            torch.zeros(b, w, dtype=torch.bool, device=device),
            torch.full((b, w), -1, dtype=torch.int64, device=device),
        )

    def finish(self, pool: "Pool", chosen: "Chosen", step: int, limits) -> "Pool":
        """The finished pool with the continuations that end within the top w merged in, the best
        w kept. Once a prompt's pool holds w finished candidates nothing enters it any more
        (early_stopping=True)."""
        width, limit = limits
        slot = torch.arange(self.width, device=chosen.scores.device)[None, :]
        finishing = chosen.ends & (chosen.place < width) & (limit >= step)
        full = (pool.done | (slot >= width)).all(1, keepdim=True)
        entering = chosen.scores + (~finishing).float() * NEG + full.float() * NEG
        merged = torch.cat([pool.scores, entering], dim=1)  # [B, 3W]
        _, best, place = top(merged, self.width, self.row_topk)
        keep = best.scatter(1, place, best)  # best first (equal scores: the pool's first); places are a permutation
        padded = F.pad(chosen.candidates, (0, self.new_tokens - step), value=self.pad_id)
        lengths = torch.full_like(chosen.candidates[:, :, -1], step)
        items = pool.items if chosen.item is None else take(torch.cat([pool.items, chosen.item], dim=1), keep)
        return Pool(
            take(torch.cat([pool.tokens, padded], dim=1), keep),
            take(torch.cat([pool.lengths, lengths], dim=1), keep),
            take(merged, keep),
            take(torch.cat([pool.done, finishing], dim=1), keep),
            items,
        )

    def advance(self, beams: "Beams", chosen: "Chosen", width: torch.Tensor) -> "Beams":
        """The running beams of the next step: each prompt's best w continuations that did not
        end, their tokens, search state and suffix K/V reordered to them (the prompt's K/V never
        moves)."""
        cum, keep, place = top(chosen.scores + chosen.ends.float() * NEG, self.width, self.row_topk)
        # best first: the next step's rows in score order, not in the order of the columns they came
        # from (a catalog's padded slots move columns, and a CPU GEMM may round a row by its position)
        keep, cum = keep.scatter(1, place, keep), cum.scatter(1, place, cum)
        place = torch.arange(self.width, device=cum.device)[None, :]
        suffix = beams.suffix
        if suffix is not None:
            b = cum.shape[0]
            rows = (take(chosen.parent, keep) + torch.arange(b, device=cum.device)[:, None] * self.width).flatten()
            suffix = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in suffix]
        return Beams(
            take(chosen.candidates, keep),
            torch.where(place < width, cum, -INF),
            tuple(take(s, keep) for s in chosen.grown),
            suffix,
        )


class Prompt(NamedTuple):
    """What the decode steps read of the prefill: per layer the prompts' K/V [T, Hkv, D], their
    boundaries [B+1] and each beam's prompt length [B*W]."""

    kv: list
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor


class Beams(NamedTuple):
    """Each prompt's running beams: tokens so far [B, K, step-1], cumulative scores [B, K] fp32,
    the subclass's search state (tensors [B, K]) and per layer the suffix K/V [B*K, step-1, Hkv, D]
    (None before the first decode)."""

    history: torch.Tensor
    cum: torch.Tensor
    state: tuple
    suffix: list | None


class Chosen(NamedTuple):
    """A step's top 2W continuations per prompt, in any order: scores [B, 2W] fp32, places among
    them, parent beams, tokens so far [B, 2W, step], whether each ends, their search state and
    the item each completes (or None)."""

    scores: torch.Tensor
    place: torch.Tensor
    parent: torch.Tensor
    candidates: torch.Tensor
    ends: torch.Tensor
    grown: tuple
    item: torch.Tensor | None


class Pool(NamedTuple):
    """Each prompt's finished candidates, best first after each merge: tokens [B, W, N] (pad after
    the end), lengths, scores (NEG where empty), whether finished, items (-1 without) [B, W]."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor
    done: torch.Tensor
    items: torch.Tensor


def top(x: torch.Tensor, k: int, row_topk=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=1) of a [B, M] tensor in any order (through row_topk where given), and each
    one's place among them (0: the best; equal values by index). The search needs only places:
    torch.topk(sorted=True) orders its k with a one-block radix sort, slow at k = 2W, where
    comparing the k with each other is one small [B, k, k] reduction."""
    values, idx = x.topk(k, dim=1, sorted=False) if row_topk is None else row_topk(x, k)
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
