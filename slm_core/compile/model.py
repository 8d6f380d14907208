"""Llama / Qwen2 / Qwen3 decoder in packed layout: every linear sees exactly the real tokens.

Prefill runs over `[ΣL, hidden]` with `cu_seqlens` marking the sequences, its last layer past q/k/v
over each sequence's last token only (all that is read of it); decode runs the W beams
of each of B prompts, which share their prompt's K/V (packed `[ΣLp, kv_heads, d]`, stored once)
and each own a suffix K/V (`[B*W, S, kv_heads, d]`). The module knows nothing of tasks, search or
quantisation.
"""

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from slm_core.errors import SpecError
from slm_core.spec import ModelSpec
from slm_kernels import packed_attention_ref, prefix_suffix_attention_ref, sequence_of_tokens
from slm_kernels.layer_ref import as_dtype, qkv_rope_ref, rms_norm_ref, silu_mul_ref

KV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class Ops(NamedTuple):
    """The per-layer ops a model runs: the PyTorch references (REFERENCE_OPS) or the Triton kernels
    that implement them (triton_ops()); same signatures."""

    packed_attention: Callable  # (q, k, v, cu_seqlens, scale, max_seqlen) -> o
    prefix_attention: Callable  # (q, k_prefix, v_prefix, k_suffix, v_suffix, scale, prefix_cu) -> o
    qkv_rope: Callable  # (qkv, cos, sin, heads, kv_heads, q_weight, k_weight, eps) -> q, k, v
    silu_mul: Callable  # (gate_up) -> silu(gate) * up


REFERENCE_OPS = Ops(
    lambda q, k, v, cu_seqlens, scale, max_seqlen: packed_attention_ref(q, k, v, cu_seqlens, scale),
    prefix_suffix_attention_ref,
    qkv_rope_ref,
    silu_mul_ref,
)


def triton_ops() -> Ops:
    """The Triton ops (imported only when asked for: triton is optional on CPU)."""
    from slm_kernels.packed_attention import packed_attention
    from slm_kernels.prefix_attention import prefix_suffix_attention
    from slm_kernels.qkv_rope import qkv_rope
    from slm_kernels.silu_mul import silu_mul

    return Ops(packed_attention, prefix_suffix_attention, qkv_rope, silu_mul)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops = REFERENCE_OPS, max_seqlen: int = 0):
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.max_seqlen = max_seqlen  # static grid bound of the packed kernel
        self.qkv = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, Hq, D], k and v [T, Hkv, D]: q and k QK-normed (Qwen3) and rotated."""
        s = self.spec
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        return self.ops.qkv_rope(self.qkv(x), cos, sin, s.num_heads, s.num_kv_heads, *norms, s.rms_norm_eps)

    def prefill(self, x, cos, sin, cu_seqlens) -> tuple[torch.Tensor, KV]:
        q, k, v = self.project(x, cos, sin)
        o = self.ops.packed_attention(q, k, v, cu_seqlens, self.scale, self.max_seqlen)
        return self.o(o.flatten(1)), (k, v)

    def prefill_at(self, x, cos, sin, cu_seqlens, rows) -> tuple[torch.Tensor, KV]:
        """prefill's output at `rows` only (each sequence's last token): K/V for every token, but
        only those rows' queries attend, each over its whole sequence (the decode kernel with one
        beam per sequence and no suffix)."""
        q, k, v = self.project(x, cos, sin)
        none = k.new_empty(rows.shape[0], 0, *k.shape[1:])  # no generated tokens
        o = self.ops.prefix_attention(q.index_select(0, rows), k, v, none, none, self.scale, cu_seqlens)
        return self.o(o.flatten(1)), (k, v)

    def decode(self, x, cos, sin, prefix: KV, prefix_cu, suffix: KV | None) -> tuple[torch.Tensor, KV]:
        q, k, v = self.project(x, cos, sin)  # one new token per beam: [B*W, H, D]
        k, v = k[:, None], v[:, None]  # [B*W, 1, Hkv, D]
        if suffix is not None:
            k, v = torch.cat([suffix[0], k], dim=1), torch.cat([suffix[1], v], dim=1)
        o = self.ops.prefix_attention(q, prefix[0], prefix[1], k, v, self.scale, prefix_cu)
        return self.o(o.flatten(1)), (k, v)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, silu_mul: Callable = silu_mul_ref):
        super().__init__()
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.silu_mul = silu_mul  # the Triton op or its reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.silu_mul(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, ops: Ops, max_seqlen: int):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, ops, max_seqlen)
        self.post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, ops.silu_mul)

    def run(
        self,
        x: torch.Tensor,
        attend: Callable[[torch.Tensor], tuple[torch.Tensor, KV]],
        rows: torch.Tensor | None = None,
    ):
        """The block over x [T, hidden]; with `rows`, its output at those rows only (attend must
        then answer for them only)."""
        a, kv = attend(self.input_norm(x))
        if rows is not None:
            # Taken from an fp32 copy (exact both ways) so that, in bf16, every consumer of the
            # residual stream is elementwise: Inductor fuses a residual add into its GEMM (addmm,
            # which first copies the residual into the output) when a consumer of the sum is not,
            # an index is not, and each fused add then makes the add before it such a case, back
            # to layer 0. Unfused, the add joins the next norm's kernel and rounds as transformers
            # does. (In fp32 the copy is no op and the adds stay fused, in fp32 too.)
            x = x.float().index_select(0, rows).to(x.dtype)
        x = x + a
        return x + self.mlp(self.post_norm(x)), kv


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, kernels: str = "reference"):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        ops = triton_ops() if kernels == "triton" else REFERENCE_OPS
        self.layers = nn.ModuleList(Block(spec, ops, max_positions) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, spec.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, spec.head_dim), persistent=False)
        self.finish()

    def finish(self) -> None:
        """Tie the embeddings and fill the RoPE tables; call again after `to_empty`."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # RoPE tables [max_positions, D] in fp32 like transformers, cast to the model dtype at use.
        inv_freq = self.spec.rope.inv_freq(self.spec.head_dim)
        angles = torch.outer(torch.arange(self.max_positions).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1).to(self.cos.device)
        self.cos = angles.cos()
        self.sin = angles.sin()

    @classmethod
    def empty(
        cls,
        spec: ModelSpec,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: str = "reference",
    ) -> "Transformer":
        """A model with uninitialised weights (no random init cost), ready for load_hf_weights."""
        with torch.device("meta"):
            model = cls(spec, max_positions, kernels)
        model = model.to_empty(device=device).to(dtype)
        model.finish()
        return model.eval().requires_grad_(False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return as_dtype(self.cos[positions], dtype), as_dtype(self.sin[positions], dtype)

    def prefill(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """input_ids: [T] packed; cu_seqlens: [N+1] int32. Returns the hidden state of each
        sequence's last token [N, hidden] before the final norm (all the graphs read) and each
        layer's K/V ([T, Hkv, D] each). The last layer runs its attention output, MLP and
        residuals at those N tokens only (W1: ~3 % of a request's FLOPs saved)."""
        idx = torch.arange(input_ids.shape[0], device=input_ids.device, dtype=cu_seqlens.dtype)
        seq = sequence_of_tokens(cu_seqlens, input_ids.shape[0])
        x = self.embed(input_ids)
        # Per-sequence positions. A CUDA-graph bucket's padding tail (slm_core.serve.replay) belongs to no
        # sequence: its positions count on from the last boundary and are clamped to the table.
        cos, sin = self._rope((idx - cu_seqlens[seq]).clamp_max(self.max_positions - 1), x.dtype)
        last = (cu_seqlens[1:] - 1).long()
        kvs = []
        for i, layer in enumerate(self.layers):
            if i + 1 < len(self.layers):
                x, kv = layer.run(x, lambda h, a=layer.attn: a.prefill(h, cos, sin, cu_seqlens))
            else:
                x, kv = layer.run(x, lambda h, a=layer.attn: a.prefill_at(h, cos, sin, cu_seqlens, last), last)
            kvs.append(kv)
        return x, kvs

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prefix: list[KV],
        prefix_cu: torch.Tensor,
        suffix: list[KV] | None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """One token for each beam of B prompts (W beams each, prompt by prompt). input_ids and
        positions: [B*W]. prefix: per layer the prompts' K/V packed [T, Hkv, D], prompt b at rows
        prefix_cu[b]..prefix_cu[b+1]-1; suffix: per layer [B*W, S, Hkv, D] or None before the first
        decode. Returns hidden [B*W, hidden] and the suffixes grown by this token ([B*W, S+1, Hkv, D])."""
        x = self.embed(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        grown = []
        for i, layer in enumerate(self.layers):
            past = None if suffix is None else suffix[i]
            x, kv = layer.run(x, lambda h, a=layer.attn, p=prefix[i]: a.decode(h, cos, sin, p, prefix_cu, past))
            grown.append(kv)
        return x, grown

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], lm_head: bool = True) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up. Every parameter must be set,
        but an untied LM head when lm_head is False (a graph that never uses it)."""
        missing = []

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                missing.append(name)
                return torch.zeros(0)
            return weights[name]

        def put(param: torch.Tensor, *names: str) -> None:
            parts = [take(n) for n in names]
            if missing:
                return
            value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if value.shape != param.shape:
                raise SpecError(
                    f"checkpoint weights {names} have shape {tuple(value.shape)}, "
                    f"the config implies {tuple(param.shape)}"
                )
            param.copy_(value)

        put(self.embed.weight, "model.embed_tokens.weight")
        put(self.norm.weight, "model.norm.weight")
        if not self.spec.tie_word_embeddings and (lm_head or "lm_head.weight" in weights):
            if "lm_head.weight" not in weights and "score.weight" in weights:
                raise SpecError(
                    "the checkpoint is a sequence-classification model (a `score` head, no "
                    "lm_head): serve it with the task key head: classifier"
                )
            put(self.lm_head.weight, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.attn
            put(layer.input_norm.weight, p + "input_layernorm.weight")
            put(layer.post_norm.weight, p + "post_attention_layernorm.weight")
            for kind in ("weight", "bias") if self.spec.qkv_bias else ("weight",):
                put(getattr(a.qkv, kind), *(f"{p}self_attn.{n}_proj.{kind}" for n in "qkv"))
            put(a.o.weight, p + "self_attn.o_proj.weight")
            if self.spec.o_bias:
                put(a.o.bias, p + "self_attn.o_proj.bias")
            if a.q_norm is not None:
                put(a.q_norm.weight, p + "self_attn.q_norm.weight")
                put(a.k_norm.weight, p + "self_attn.k_norm.weight")
            put(layer.mlp.gate_up.weight, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer.mlp.down.weight, p + "mlp.down_proj.weight")
            if self.spec.mlp_bias:
                put(layer.mlp.gate_up.bias, p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
                put(layer.mlp.down.bias, p + "mlp.down_proj.bias")
        if missing:
            raise SpecError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
