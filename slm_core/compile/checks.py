"""What the build measures before it writes a package: the compiled graph against the eager one,
an FP8 build against the same task in bf16 (its accuracy gate), and the time of calls at the
task's bounds (which the admission rule plans with). Each judges answers through the task
(Task.difference, check, gate)."""

from dataclasses import dataclass
from typing import Any

from slm_core.errors import InputError, SpecError
from slm_core.serve.runtime import Runtime
from slm_core.tasks import Difference, Task

CHECK_TEXTS = [
    "cheap flights from berlin to rome in may",
    "is this review positive? the battery died after two days",
    "weather",
    "best running shoes for flat feet under 100 dollars",
    "how do i reset my router password",
]
# The FP8 accuracy gate's evaluation set: the check texts and more of the kind.
EVAL_TEXTS = CHECK_TEXTS + [
    "wireless noise cancelling headphones with long battery life",
    "the delivery was late and the package was damaged",
    "vegetarian lasagna recipe without ricotta",
    "what time does the pharmacy on main street close",
    "great hotel, friendly staff, but the breakfast was cold",
    "python list comprehension with two loops",
    "cheap used cars near me with low mileage",
    "is it safe to travel to iceland in winter",
    "return policy for items bought on sale",
    "kids bicycle 20 inch with gears",
    "symptoms of a cold versus the flu",
]


@dataclass(frozen=True)
class GateThresholds:
    """The FP8 accuracy gate against bf16 (archiver --fp8-max-diff, --fp8-min-shared)."""

    max_diff: float = 0.05  # score: the largest |difference| of a probability
    min_shared: float = 0.6  # beam: the least mean share of bf16's candidates kept


def fitting(task: Task, texts: list[str]) -> list[str]:
    """The texts that fit the task's token bound with its template."""
    fit = [
        t
        for t, ids in zip(texts, task.tokenizer.encode(texts))
        if not isinstance(ids, InputError) and len(ids) <= task.sequence_tokens
    ]
    if not fit:
        raise SpecError("no check text fits the task bounds: does the template alone exceed them?")
    return fit


def compare(reference: Runtime, candidate: Runtime, batches: list[list[Any]]) -> list[Difference]:
    """Each request of each batch: its answer from `reference` alone against its answer from
    `candidate` in a call with the rest of its batch."""
    task = reference.task
    differences = []
    for batch in batches:
        for value, got in zip(batch, candidate.run(batch)):
            (want,) = reference.run([value])
            differences.append(task.difference(want.answer, got.answer))
    return differences


def check_compiled(eager: Runtime, compiled: Runtime) -> dict[str, Any]:
    """The compiled engine against the eager one on the check texts, each request alone, then a
    full call of max_batch requests; SpecError past the task's tolerance."""
    task = eager.task
    samples = fitting(task, CHECK_TEXTS)
    batches = [[task.request_of(texts)] for texts in (samples[:1], samples, samples[1:], samples[2:]) if texts]
    if task.max_batch > 1:
        batches.append([task.request_of(samples[i % len(samples) :]) for i in range(task.max_batch)])
    check = task.check(compare(eager, compiled, batches), task.spec.precision)
    if not check.pop("passes"):
        raise SpecError(f"the compiled graph disagrees with the eager graph: {check}")
    return check


def fp8_gate(reference: Runtime, quantized: Runtime, thresholds: GateThresholds) -> dict[str, Any]:
    """The FP8 engine against the task in bf16 (`reference`, eager) on EVAL_TEXTS, a request's
    worth of texts at a time; SpecError when it fails the thresholds."""
    task = reference.task
    samples, k = fitting(task, EVAL_TEXTS), task.request_sequences
    values = [task.request_of(samples[i : i + k]) for i in range(0, len(samples), k)][: task.gate_requests]
    gate = task.gate(compare(reference, quantized, [[v] for v in values]), thresholds.max_diff, thresholds.min_shared)
    if not gate.pop("passes"):
        raise SpecError(
            f"the {quantized.task.spec.precision} build fails its accuracy gate against bf16: {gate} "
            "(thresholds: archiver --fp8-max-diff, --fp8-min-shared)"
        )
    return gate


CPU_TIMING_MS = 1000.0  # a CPU build times a call again while its samples took less than this


def timed_call(engine: Runtime, sequences: int, tokens: int, repeat: int) -> float:
    """Milliseconds of one synthetic call of this size. On CUDA the fastest of `repeat` after one
    warm-up (a CUDA-graph bucket's first replay; other work on the GPU slows some calls, not all).
    On a CPU, whose engine has run already, the fastest of up to `repeat` calls within about a
    second: a call at the bounds there takes seconds and is timed once, while a short call, which
    other work on the host inflates many times over (and admission with it: every request
    refused), is timed again."""
    if engine.device.type != "cuda":
        times = [engine.synthetic_call(sequences, tokens)]
        while len(times) < repeat and sum(times) < CPU_TIMING_MS:
            times.append(engine.synthetic_call(sequences, tokens))
        return min(times)
    return min([engine.synthetic_call(sequences, tokens) for _ in range(repeat + 1)][1:])


def time_calls(engine: Runtime, repeat: int = 5) -> dict[str, float]:
    """Milliseconds of one graph call at the task's bounds, copy-in to results on the host, per
    number of requests in the call (1, 2, 4, ... and max_batch; JSON keys), each request at its
    sequence and token bounds: the slowest call a worker makes with that many requests, which
    admission plans with (slm_core.serving). timed_call's: a call alone on the GPU, as admission
    counts it (it counts the calls beside it apart). Other work on the same GPU while the build
    runs (another build, tests) slows some of the calls, not all, and their median up to 1.7x
    (bench/RESULTS.md)."""
    task = engine.task
    batches = sorted({1 << i for i in range(task.max_batch.bit_length())} | {task.max_batch})
    sequences = {b: b * task.request_sequences for b in batches}
    return {str(b): timed_call(engine, n, n * task.sequence_tokens, repeat) for b, n in sequences.items()}


LENGTH_SHARES = (8, 4, 2, 1)  # the sequence lengths timed: the token bound over each


def time_sizes(engine: Runtime, full_call_ms: float | None = None) -> list[list]:
    """Milliseconds of a call by its size, for deadline admission by what a call holds
    (slm_core.serve.deadline): [sequences, tokens per sequence, ms] for 1, 2, 4 ... sequences up
    to a full call's and sequences of 1/8, 1/4, 1/2 and all of the token bound. Each point
    over-states any call it covers (no more sequences, none longer) by at most 2x in either.
    full_call_ms: a full call at the bounds as time_calls measured it, taken as it is. Each point
    timed_call's, the fastest of 2 on CUDA."""
    task = engine.task
    full = task.call_texts
    counts = sorted({1 << i for i in range(full.bit_length())} | {full})
    lengths = sorted({max(1, -(-task.sequence_tokens // share)) for share in LENGTH_SHARES})

    def timed(n: int, length: int) -> float:
        if full_call_ms is not None and (n, length) == (full, task.sequence_tokens):
            return full_call_ms
        return timed_call(engine, n, n * length, repeat=2)

    return [[n, length, timed(n, length)] for n in counts for length in lengths]
