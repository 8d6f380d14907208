"""Logical matrix FLOPs, as the MFU formula counts them: linear layers, the LM head (only the rows
actually computed) and attention (QKᵀ and PV, causal pairs only), 2 FLOPs per multiply-add;
nothing else. A prefill's last layer runs its o-projection and MLP at each sequence's last token
only, whose query alone attends (slm_core.compile.model): only those rows are counted. The tasks
count their requests with these (Task.flops)."""

from slm_core.spec import ModelSpec


def linear_flops_per_token(spec: ModelSpec) -> int:
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    return 2 * per_layer * spec.num_layers


def attention_flops(spec: ModelSpec, pairs: int, layers: int | None = None) -> int:
    """QKᵀ and PV over `pairs` (query, key) pairs, all query heads, of all layers (or `layers`)."""
    return 2 * 2 * spec.num_heads * spec.head_dim * pairs * (spec.num_layers if layers is None else layers)


def last_layer_rest(spec: ModelSpec) -> int:
    """Per row, the FLOPs of the last layer past q/k/v (o-projection, MLP): a prefill skips them
    at every token but each sequence's last."""
    h, i = spec.hidden_size, spec.intermediate_size
    return 2 * (spec.q_size * h + h * 2 * i + i * h)


def prefill_flops(spec: ModelSpec, lengths: list[int]) -> int:
    """Linears and attention of a prefill over sequences of `lengths` tokens."""
    tokens, last = sum(lengths), len(lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in lengths)
    return (
        linear_flops_per_token(spec) * tokens
        - last_layer_rest(spec) * (tokens - last)
        + attention_flops(spec, causal_pairs, spec.num_layers - 1)
        + attention_flops(spec, tokens, 1)
    )


def head_flops(spec: ModelSpec, rows: int, outputs: int) -> int:
    """A head of `outputs` rows (label tokens, a classifier, the vocabulary) over `rows` hidden states."""
    return 2 * spec.hidden_size * outputs * rows


def decode_flops(spec: ModelSpec, prompt: int, width: int, new_tokens: int) -> int:
    """new_tokens - 1 decode steps of `width` beams, each attending to the prompt and its own suffix."""
    pairs = sum(width * (prompt + t) for t in range(1, new_tokens))
    return linear_flops_per_token(spec) * width * (new_tokens - 1) + attention_flops(spec, pairs)


def static_fp8_flops(spec: ModelSpec, rows: int, skipped: int = 0) -> int:
    """Of the linears over `rows` rows, those fp8-static runs in E4M3: each layer's qkv and MLP,
    less the last layer's MLP at the `skipped` prefill rows (those not at a sequence's end)."""
    mlp_per_layer = 2 * 3 * spec.hidden_size * spec.intermediate_size
    qkv_per_layer = 2 * spec.hidden_size * (spec.q_size + 2 * spec.kv_size)
    return (mlp_per_layer + qkv_per_layer) * spec.num_layers * rows - mlp_per_layer * skipped
