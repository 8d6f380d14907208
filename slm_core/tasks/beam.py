"""Fixed beam search: a prompt -> its W best continuations of up to N new tokens, best first, each
with its token ids (the stop token included when it ended on one), its text (decoded without
special tokens) and its cumulative log-probability, as transformers' generate(num_beams=W,
num_return_sequences=W, early_stopping=True, length_penalty=0.0) ranks them."""

from typing import Any, ClassVar

from slm_core import flops
from slm_core.errors import InputError, SpecError
from slm_core.spec import ModelSpec
from slm_core.tasks.base import Difference, Task


class BeamTask(Task):
    kind = "beam"
    api = "beam"
    field = "prompt"
    placeholder = "{prompt}"
    graph = "beam"
    answer = ("candidates",)
    pad_sequences = False  # a padding prompt would cost W beams at every decode step
    # Best served on the H200 (bench/RESULTS.md): 8 prompts per call, split by two workers.
    cuda_max_batch = 8
    # A shared candidate's score. It sums N bf16 log-probabilities over the whole vocabulary:
    # transformers' own bf16 beam scores are 0.08-0.21 from fp32 on the H200, and a compiled graph
    # that fuses differently from eager may differ by as much. In fp32 a score is a sum of up to N
    # differences of two numbers of 10-30 (a logit, the vocabulary's logsumexp) whose GEMMs
    # compiled and eager block differently: 1.5e-4 measured on SmolLM2's CPU build. fp8-static:
    # compiled and eager quantise the post-norm activations from different roundings (Inductor
    # fuses the norm into the quantisation), values near an E4M3 step land apart and beam search
    # amplifies it (H200: 0.35-0.38, 65-69 % of candidates shared; bf16 0.094, 90 %); for it this
    # check guards against a broken compile only, and its accuracy criterion is the gate against bf16.
    tolerance: ClassVar[dict[str, float]] = {"fp32": 1e-3, "bf16": 0.25, "fp8-static": 0.5}
    min_shared: ClassVar[dict[str, float]] = {"fp32": 1.0, "bf16": 0.75, "fp8-static": 0.5}
    gate_requests = 8  # a prompt's call is the costly one

    def __init__(self, spec, tokenizer):
        super().__init__(spec, tokenizer)
        if (spec.head, spec.output) != ("labels", "probs") or spec.labels:
            raise SpecError("task keys 'labels', 'head' and 'output' are for score tasks")
        self.stop_ids = self.tokenizer.single_tokens(spec.stop, "stop string")

    @property
    def width(self) -> int:
        return self.spec.beam_width

    @property
    def new_tokens(self) -> int:
        return self.spec.new_tokens

    @property
    def request_sequences(self) -> int:
        return 1

    @property
    def sequence_tokens(self) -> int:
        return self.spec.max_prompt_tokens

    @property
    def max_positions(self) -> int:
        return self.spec.max_prompt_tokens + self.spec.new_tokens

    def encode(self, values: list[Any]) -> "list[list[list[int]] | InputError]":
        bound = self.spec.max_prompt_tokens
        out: list = []
        for prompt in values:
            try:
                self.tokenizer.check(prompt, "prompt", "max_prompt_tokens", bound)
                out.append(None)
            except InputError as e:
                out.append(e)
        valid = [i for i, o in enumerate(out) if o is None]
        for i, ids in zip(valid, self.tokenizer.encode([values[i] for i in valid])):
            out[i] = InputError(f"prompt {ids}") if isinstance(ids, InputError) else [ids] if len(ids) <= bound else InputError(
                f"prompt is {len(ids)} tokens with the template, over max_prompt_tokens={bound}",
                bound="max_prompt_tokens", limit=bound)
        return out

    def unpack(self, outputs: list[list], first: int, count: int) -> list[dict[str, Any]]:
        rows, ends, scores = (out[first] for out in outputs)  # [W][new_tokens], [W], [W]
        ids = [row[:end] for row, end in zip(rows, ends)]
        return [{"text": text, "token_ids": i, "score": score}
                for text, i, score in zip(self.tokenizer.decode_each(ids), ids, scores)]

    def body(self, answer: list[dict[str, Any]]) -> dict:
        return {"candidates": answer}

    def outputs(self) -> list[str]:
        w, n = self.width, self.new_tokens
        return [f"tokens int64 [prompts, {w}, {n}]", f"lengths int64 [prompts, {w}]", f"scores float32 [prompts, {w}]"]

    def constants(self) -> dict:
        return {"stop_ids": self.stop_ids}  # a candidate ends at one of these

    def request_of(self, texts: list[str]) -> str:
        return texts[0]

    def difference(self, want: list[dict], got: list[dict]) -> Difference:
        scores = {tuple(c["token_ids"]): c["score"] for c in want}
        shared = [abs(c["score"] - scores[tuple(c["token_ids"])]) for c in got if tuple(c["token_ids"]) in scores]
        return Difference(tuple(shared), len(shared) / max(1, len(want)))

    def gate(self, differences: list[Difference], max_diff: float, min_shared: float) -> dict[str, Any]:
        shares = [d.shared for d in differences]
        mean = sum(shares) / len(shares)
        return {"against": "bf16", "prompts": len(shares), "shared_candidates": mean, "worst_prompt": min(shares),
                "min_allowed": min_shared, "passes": mean >= min_shared}

    def flops(self, model: ModelSpec, value: Any, precision: str) -> tuple[int, int]:
        (prompt,) = self.token_lengths(value)
        w, n = self.width, self.new_tokens
        head_rows = 1 + w * (n - 1)  # the prompt's last row, then W rows per decode step
        total = (flops.prefill_flops(model, [prompt]) + flops.decode_flops(model, prompt, w, n)
                 + flops.head_flops(model, head_rows, model.vocab_size))
        fp8 = flops.static_fp8_flops(model, prompt + w * (n - 1), skipped=prompt - 1) if precision == "fp8-static" else 0
        return total, fp8
