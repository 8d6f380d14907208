"""The beam search graph constrained to a catalog's trie (slm_core.item_trie), which it takes as
inputs: a new catalog within the task's bounds needs no recompile.

Each running beam carries its trie node and whether it has ended (its last token a stop). A step
gives each beam the F slots of its node's children at the step's level (F: the level's largest
fan-out), valid where a child exists, can still reach an item within the prompt's new tokens and
is not excluded by the request, plus one column per stop token, valid where the node completes an
item that is not excluded. Columns not valid score -inf, as transformers' prefix_allowed_tokens_fn
masks them; an ended beam (transformers keeps finished candidates as running backups at -1e9)
may only stop again. The top 2W of a prompt's K×(F+S) columns follow.

Scores normalise over the whole vocabulary (transformers': the full LM head and its
log-sum-exp) or, with catalog_scores "catalog", over the catalog's tokens only: the LM head then
computes just their rows, gathered once per call.

The arrays may be padded beyond the catalog (ItemTrie.graph_arrays: room for a catalog swapped in
later, in place): padding vocab entries (-1) score -inf, padding nodes have no children and
padding slots are never valid, so no answer changes.
"""

import torch
import torch.nn.functional as F

from slm_core.compile.beam_graph import INF, BeamGraph, top


class CatalogGraph(BeamGraph):
    def __init__(self, *args, exclude: int, local_scores: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.exclude = exclude  # excluded edges per level (and item ends per depth) in a prompt's options
        self.local_scores = local_scores

    @classmethod
    def options(cls, task) -> dict:
        return {"exclude": task.spec.max_exclude, "local_scores": task.spec.catalog_scores == "catalog"}

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, options: torch.Tensor, *catalog: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """BeamGraph's, with `options` rows [B, 2 + 2*N*E] (width, new tokens, the excluded edges of
        each level and item ends of each depth, -1 padded) and the catalog's arrays (vocab, then
        per level first, edges, slots); also returns each candidate's item [B, W] int64."""
        return self.search(input_ids, cu_seqlens, options, catalog)

    def start(self, b: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (
            torch.zeros(b, 1, dtype=torch.int64, device=device),  # the root
            torch.zeros(b, 1, dtype=torch.bool, device=device),
        )

    def head(self, constants: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With catalog scores: the LM head's rows of the catalog's tokens [V', hidden], and which
        of its entries pad `vocab` (-1: room for a catalog swapped in later), whose columns score
        -inf and so count in no normaliser."""
        if not self.local_scores:
            return None
        vocab = constants[0]
        return self.model.lm_head.weight.index_select(0, vocab.clamp_min(0).long()), vocab < 0

    def logits(self, hidden: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if head is None:
            return self.model.logits(hidden)
        rows, padding = head
        return F.linear(self.model.norm(hidden), rows).masked_fill(padding, -INF)

    def expand(
        self,
        logits: torch.Tensor,
        cum: torch.Tensor,
        state: tuple[torch.Tensor, ...],
        step: int,
        options: torch.Tensor,
        constants: tuple[torch.Tensor, ...],
    ) -> tuple:
        node, ended = state  # [B, K] each
        b, beams = cum.shape
        d, e, s = step - 1, self.exclude, self.stop_ids.shape[0]
        vocab = constants[0].long()
        first, edges, slots = constants[1 + 3 * d : 4 + 3 * d]
        f = slots.shape[0]
        u = node.reshape(-1)  # [R]: each beam's node at depth d
        limit = options[:, 1:2].long().expand(b, beams).reshape(-1, 1)  # [R, 1]

        lo, hi = first[u].long(), first[u + 1].long()
        idx = (lo[:, None] + slots[None, :].long()).clamp_max(edges.shape[0] - 1)  # [R, F] edges at level d
        edge = edges[idx].long()  # [R, F, 3]: vocab index, item, reach
        # the request's excluded edges of this level, as slots of each beam's node: O(R * E)
        killed = options[:, 2 + d * e : 2 + (d + 1) * e].long().repeat_interleave(beams, 0)  # [R, E], -1 padded
        at = killed - lo[:, None]
        at = torch.where((killed >= 0) & (at >= 0) & (at < f), at, f)  # column f: not a slot of this node
        excluded = torch.zeros(u.shape[0], f + 1, dtype=torch.bool, device=u.device).scatter(1, at, True)[:, :f]
        valid = (
            ((lo[:, None] + slots[None, :]) < hi[:, None]) & (edge[..., 2] <= limit) & ~excluded & ~ended.reshape(-1, 1)
        )

        if d == 0:  # the root completes no item, so no stop is excluded there
            completes = torch.full_like(u, -1)
            stop_excluded = torch.zeros_like(ended.reshape(-1))
        else:
            completes = constants[2 + 3 * (d - 1)][u, 1].long()  # the item u completes, or -1
            ends_here = options[:, 2 + (self.new_tokens + d - 1) * e : 2 + (self.new_tokens + d) * e].long()
            stop_excluded = (u.view(b, beams, 1) == ends_here[:, None, :]).any(-1).reshape(-1)
        stop_ok = ((completes >= 0) & ~stop_excluded) | ended.reshape(-1)  # [R]

        children_cols = edge[..., 0] if self.local_scores else vocab[edge[..., 0]]
        stop_cols = torch.arange(s, device=logits.device) if self.local_scores else self.stop_ids
        if self.topk is not None and not self.local_scores:
            lse = self.topk(logits, 1)[2][:, None]  # one pass over the [R, V] logits
        else:
            lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        child = logits.gather(1, children_cols).float() - lse
        stop = logits[:, stop_cols].float() - lse
        columns = torch.cat([torch.where(valid, child, -INF), torch.where(stop_ok[:, None], stop, -INF)], dim=1)
        total = (columns.view(b, beams, f + s) + cum[:, :, None]).flatten(1)
        # 2W columns of -inf behind, so that a prompt has 2W candidates however few its beams have
        total = torch.cat([total, torch.full((b, 2 * self.width), -INF, device=total.device)], dim=1)
        # torch.topk: the columns follow the catalog's fan-out, a dynamic size (row_topk needs a static one)
        scores, flat, place = top(total, 2 * self.width)
        flat = torch.where(flat < beams * (f + s), flat, 0)

        def pick(per_column: torch.Tensor) -> torch.Tensor:  # [R, F+S] -> each candidate's [B, 2W]
            return per_column.reshape(b, beams * (f + s)).gather(1, flat)

        is_stop = (flat % (f + s)) >= f
        # a stopped beam may only stop again: any node of the next depth serves it (node 0)
        next_node = pick(torch.cat([idx, torch.zeros_like(idx[:, :1]).expand(-1, s)], dim=1))
        item = pick(torch.cat([edge[..., 1], completes[:, None].expand(-1, s)], dim=1))
        token = pick(torch.cat([vocab[edge[..., 0]], self.stop_ids[None, :].expand(u.shape[0], -1)], dim=1))
        return scores, place, flat // (f + s), token, is_stop, (next_node, is_stop), item
