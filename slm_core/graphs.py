"""The two request graphs. Each is one nn.Module whose forward is a whole request: fixed loops,
no host syncs, no data-dependent Python control flow, so torch.export captures it as one graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

from slm_core.errors import SpecError
from slm_core.model import Transformer

NEG = -1.0e9  # transformers' "impossible" score: keeps its ordering of exhausted candidates


class ScoreGraph(nn.Module):
    """Packed texts -> label probabilities at each text's last token."""

    def __init__(self, model: Transformer, label_ids: list[int]):
        super().__init__()
        self.model = model
        # Only the label rows of the LM head are ever computed: [n_labels, hidden].
        self.label_ids = list(label_ids)
        self.register_buffer("label_weight", model.lm_head.weight.detach()[label_ids].clone())

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int32 packed; cu_seqlens: [N+1] int32. Returns [N, n_labels] fp32."""
        hidden, _ = self.model.prefill(input_ids, cu_seqlens)
        last = hidden.index_select(0, cu_seqlens[1:] - 1)  # [N, hidden]
        logits = F.linear(self.model.norm(last), self.label_weight)
        return torch.softmax(logits.float(), dim=-1)


class BeamGraph(nn.Module):
    """One prompt -> W candidates of up to N new tokens, as transformers' beam search
    (early_stopping=True, length_penalty=0) ranks them.

    Each step expands the running beams, takes the global top 2W; candidates that end (stop token,
    or the last step) among the top W go to a finished pool of W, the rest refill W running beams.
    """

    def __init__(self, model: Transformer, beam_width: int, new_tokens: int, stop_ids: list[int], pad_id: int):
        super().__init__()
        if 2 * beam_width > model.spec.vocab_size:
            raise SpecError(f"beam_width={beam_width} needs 2 * beam_width <= vocab size {model.spec.vocab_size}")
        self.model = model
        self.width = beam_width
        self.new_tokens = new_tokens
        self.pad_id = pad_id
        self.register_buffer("stop_ids", torch.tensor(stop_ids, dtype=torch.int64), persistent=False)
        # Only the top W of the 2W candidates may finish in a step (the rest are backups).
        self.register_buffer("top_w", torch.arange(2 * beam_width) < beam_width, persistent=False)

    def _expand(self, logits: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """logits: [B, V]; cum: [B] fp32. Returns the global top 2W of B×2W continuations:
        scores [2W] fp32 (sorted), parent beam [2W], token [2W]."""
        k = 2 * self.width
        top_logits, top_ids = logits.topk(k, dim=-1)  # per beam, in the model dtype
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(1, top_ids)  # FP32 scores of those ids
        scores, flat = (log_probs + cum[:, None]).flatten().topk(k)
        return scores, flat // k, top_ids.flatten().index_select(0, flat)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids: [Lp] int32. Returns tokens [W, N] int64 (pad after the end), lengths [W] int64,
        scores [W] fp32 (cumulative log-probabilities), best first."""
        w, n, dev = self.width, self.new_tokens, input_ids.device
        lp = input_ids.shape[0]
        cu = torch.arange(2, device=dev, dtype=torch.int32) * lp  # [0, Lp]
        hidden, prefix = self.model.prefill(input_ids, cu)  # prompt K/V: once, [Lp, Hkv, D] per layer
        logits = self.model.logits(hidden[-1:])  # [1, V]

        history = torch.zeros(1, 0, dtype=torch.int64, device=dev)  # running beams' tokens [B, step-1]
        cum = torch.zeros(1, dtype=torch.float32, device=dev)
        suffix = None  # per layer [W, step-1, Hkv, D] from the first decode on
        pool_tokens = torch.full((w, n), self.pad_id, dtype=torch.int64, device=dev)
        pool_lengths = torch.zeros(w, dtype=torch.int64, device=dev)
        pool_scores = torch.full((w,), NEG, dtype=torch.float32, device=dev)
        pool_done = torch.zeros(w, dtype=torch.bool, device=dev)

        for step in range(1, n + 1):  # `step` tokens generated after this iteration
            if step > 1:
                hidden, suffix = self.model.decode(history[:, -1], lp + step - 2, prefix, suffix)
                logits = self.model.logits(hidden)  # [W, V]
            scores, parent, token = self._expand(logits, cum)
            candidates = torch.cat([history.index_select(0, parent), token[:, None]], dim=1)  # [2W, step]
            ends = torch.isin(token, self.stop_ids)
            if step == n:
                ends = torch.ones_like(ends)

            # Finished pool: merge candidates that end within the top W, keep the best W. Once the
            # pool holds W finished candidates nothing enters it any more (early_stopping=True).
            entering = scores + (~(ends & self.top_w)).float() * NEG + pool_done.all().float() * NEG
            keep = torch.cat([pool_scores, entering]).topk(w).indices
            padded = F.pad(candidates, (0, n - step), value=self.pad_id)
            pool_tokens = torch.cat([pool_tokens, padded]).index_select(0, keep)
            pool_lengths = torch.cat([pool_lengths, torch.full_like(token, step)]).index_select(0, keep)
            pool_scores = torch.cat([pool_scores, entering]).index_select(0, keep)
            pool_done = torch.cat([pool_done, ends & self.top_w]).index_select(0, keep)

            if step < n:  # running beams: the best W that did not end; reorder history and suffix K/V only
                running = scores + ends.float() * NEG
                cum, keep = running.topk(w)
                history = candidates.index_select(0, keep)
                if suffix is not None:
                    beams = parent.index_select(0, keep)
                    suffix = [(k.index_select(0, beams), v.index_select(0, beams)) for k, v in suffix]
        return pool_tokens, pool_lengths, pool_scores
