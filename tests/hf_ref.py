"""transformers references for the engine's two tasks, on token ids."""

import torch

GENERATE = dict(do_sample=False, early_stopping=True, length_penalty=0.0)


@torch.no_grad()
def hf_score(model, ids_per_text: list[list[int]], label_ids: list[int]) -> list[list[float]]:
    """Each text alone (no batching, no padding): softmax over the label logits at its last token."""
    rows = []
    for ids in ids_per_text:
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
        rows.append(torch.softmax(logits[label_ids], dim=-1).tolist())
    return rows


@torch.no_grad()
def hf_beam(model, prompt_ids: list[int], width: int, new_tokens: int, stop_ids: list[int], pad_id: int):
    """[(token ids up to the end, score)] from generate(), best first, pad after the end stripped
    using the stop ids (a candidate ends at its first stop token or after new_tokens)."""
    out = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width, num_return_sequences=width, max_new_tokens=new_tokens,
        eos_token_id=stop_ids or None, pad_token_id=pad_id, output_scores=True, output_logits=True,
        return_dict_in_generate=True,
        **GENERATE,
    )
    sequences = out.sequences[:, len(prompt_ids):].tolist()
    if width == 1:  # generate() runs greedy search: no sequences_scores, sum the chosen log-probs
        steps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, sequences[0])]
        scores = [sum(steps[: _end(sequences[0], stop_ids)])]
    else:
        scores = out.sequences_scores.tolist()
    result = []
    for seq, score in zip(sequences, scores):
        end = _end(seq, stop_ids)
        assert all(t == pad_id for t in seq[end:]), seq
        result.append((seq[:end], score))
    return result


def _end(seq: list[int], stop_ids: list[int]) -> int:
    return next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq))


def assert_same_beams(ours: list[dict], ref: list[tuple[list[int], float]], tol: float = 5e-4) -> None:
    """The same candidates in the same order, scores within `tol`: fp32 sums of up to 5 log-probs,
    whose GEMMs oneDNN blocks by shape and CPU (packed [T, H] here, [1, T, H] in transformers): an
    AMD EPYC measured 1.1e-4 on SmolLM2 (2026-11-30), earlier machines under 1e-4."""
    assert [c["token_ids"] for c in ours] == [ids for ids, _ in ref]
    for c, (_, score) in zip(ours, ref):
        assert abs(c["score"] - score) <= tol, (c, score)
