"""Logical matrix FLOPs of a request and effective MFU, exactly as DESIGN.md defines them:
linear layers, the LM head (only the rows actually computed) and attention (QKᵀ and PV, causal
pairs only), 2 FLOPs per multiply-add; nothing else. A prefill's last layer runs its o-projection
and MLP at each sequence's last token only, whose query alone attends (slm_core.model): only
those rows are counted."""

from slm_core.spec import ModelSpec

PEAK = {"bf16": 989e12, "fp8": 1979e12}  # H200 dense peaks, FLOP/s


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
    return (linear_flops_per_token(spec) * tokens - last_layer_rest(spec) * (tokens - last)
            + attention_flops(spec, causal_pairs, spec.num_layers - 1) + attention_flops(spec, tokens, 1))


def score_flops(spec: ModelSpec, lengths: list[int], labels: int) -> int:
    return prefill_flops(spec, lengths) + 2 * spec.hidden_size * labels * len(lengths)


def beam_flops(spec: ModelSpec, prompt: int, width: int, new_tokens: int) -> int:
    """Prefill of the prompt (LM head on its last row), then new_tokens - 1 decode steps of W beams,
    each beam attending to the prompt plus its own suffix."""
    pairs = sum(width * (prompt + t) for t in range(1, new_tokens))
    return (prefill_flops(spec, [prompt]) + linear_flops_per_token(spec) * width * (new_tokens - 1)
            + attention_flops(spec, pairs) + beam_head_flops(spec, width, new_tokens))


def beam_head_flops(spec: ModelSpec, width: int, new_tokens: int) -> int:
    """The LM head of a beam request: the prompt's last row, then W rows per decode step."""
    return 2 * spec.hidden_size * spec.vocab_size * (1 + width * (new_tokens - 1))


def mlp_flops_per_token(spec: ModelSpec) -> int:
    """The MLP's share of linear_flops_per_token: what the fp8 precisions run in E4M3."""
    return 2 * 3 * spec.hidden_size * spec.intermediate_size * spec.num_layers


def fp8_flops(spec: ModelSpec, precision: str, tokens: int, head: int = 0, skipped: int = 0) -> int:
    """Of a request's FLOPs, those in E4M3 linears (slm_core.fp8): the MLP over its `tokens` rows
    (less the last layer's over `skipped` prefill rows, those not at a sequence's end) for
    fp8-mlp; the LM head's `head` FLOPs too for fp8-mlp-lmhead; for fp8-static the qkv
    projection over all `tokens` rows too; 0 for bf16 and fp32."""
    if not precision.startswith("fp8"):
        return 0
    mlp = mlp_flops_per_token(spec) * tokens - mlp_flops_per_token(spec) // spec.num_layers * skipped
    qkv = 2 * spec.hidden_size * (spec.q_size + 2 * spec.kv_size) * spec.num_layers * tokens
    return mlp + (head if precision == "fp8-mlp-lmhead" else 0) + (qkv if precision == "fp8-static" else 0)


def beam_fp8_flops(spec: ModelSpec, precision: str, prompt: int, width: int, new_tokens: int) -> int:
    """fp8_flops of a beam request: the MLP over the prompt and the decode rows, the LM head's rows."""
    return fp8_flops(spec, precision, prompt + width * (new_tokens - 1), beam_head_flops(spec, width, new_tokens),
                     skipped=prompt - 1)


def mfu(qps: float, flops_per_request: float, precision: str = "bf16") -> float:
    return qps * flops_per_request / PEAK[precision]


def mfu_effective(qps: float, flops_per_request: float, fp8_per_request: float = 0.0) -> float:
    """DESIGN.md's effective MFU: each precision's FLOPs against that precision's dense peak."""
    return qps * ((flops_per_request - fp8_per_request) / PEAK["bf16"] + fp8_per_request / PEAK["fp8"])
