"""Deadlines at run time: a request waits only as long as its caller allows, and past that it is
refused before it reaches the graph (504), never computed late.

A request's deadline is its header X-Slm-Deadline-Ms (milliseconds from its arrival), else the
archive's (the deadline its queue was sized for; none on a CPU build unless one was given). Its
arrival is the X-Request-Start header a proxy in front stamps (nginx: `proxy_set_header
X-Request-Start "t=${msec}"`; seconds, milliseconds or microseconds since the epoch, told apart by
magnitude), which counts TorchServe's queue too; without one, the moment the worker took it. A
request is refused when the time it has waited plus the call it would join passes its deadline.

The call is estimated from what it holds, once its requests are tokenized: the build times calls
by size (slm_core.compile.checks.time_sizes), and the smallest timed call with at least as many
sequences, none shorter than the call's longest, bounds it from above (a call's time grows with
its sequences and their length). An archive without those timings counts the call at the token
bounds (its number of requests, each at its sequence and token bounds).
"""

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slm_core.errors import InputError, bounded
from slm_core.serving import call_time

HEADER = "x-slm-deadline-ms"
ARRIVAL = "x-request-start"
MAX_DEADLINE_MS = 3_600_000.0
STATUS = 504


@dataclass(frozen=True)
class Deadlines:
    default_ms: float | None  # the archive's deadline, or None: only requests that carry one have one
    # the build's calls at the token bounds, as the manifest holds them: {"1": ms, "2": ms, ...}
    call_ms: Mapping[str, float] = field(default_factory=dict)
    # the build's calls by size, as the manifest holds them: [sequences, tokens per sequence, ms]
    sizes: Sequence[Sequence[float]] = ()

    def call(self, requests: int, sequences: int | None = None, longest: int | None = None) -> float:
        """The milliseconds a call of `requests` requests takes at most: of `sequences` sequences,
        the longest of `longest` tokens, where the build timed calls by size and these are given;
        else at the token bounds (slm_core.serving.call_time); 0 for a build without timings."""
        if self.sizes and sequences is not None and longest is not None:
            covering = [ms for n, length, ms in self.sizes if n >= sequences and length >= longest]
            if covering:
                return min(covering)
        return call_time(self.call_ms, requests) if self.call_ms else 0.0

    def budget(self, headers) -> float | None:
        """A request's deadline in milliseconds, or None. InputError for a header that is no
        positive number of milliseconds within MAX_DEADLINE_MS."""
        given = headers.get(HEADER)
        if given is None:
            return self.default_ms
        try:
            value = float(given)
        except ValueError:
            value = math.nan
        if not 0 < value <= MAX_DEADLINE_MS:
            raise InputError(
                f"header X-Slm-Deadline-Ms must be a positive number of milliseconds up to "
                f"{MAX_DEADLINE_MS:.0f}, got {bounded(str(given), 40)!r}"
            )
        return value

    def refusal(
        self, headers, received: float, requests: int, sequences: int | None = None, longest: int | None = None
    ) -> InputError | None:
        """The 504 for a request that cannot be answered within its deadline in its call (`call`'s
        arguments), or None. received: time.monotonic() when the worker took it."""
        budget = self.budget(headers)
        if budget is None:
            return None
        waited = waited_ms(headers, received)
        call = self.call(requests, sequences, longest)
        if waited + call <= budget:
            return None
        size = f" ({sequences} sequence(s), the longest {longest} tokens)" if sequences is not None else ""
        return InputError(
            f"deadline of {budget:g} ms: waited {waited:.1f} ms and a call of {requests} request(s){size} takes "
            f"up to {call:.1f} ms, so it is not computed",
            bound="deadline_ms",
            status=STATUS,
        )


def waited_ms(headers, received: float) -> float:
    """Milliseconds since the request's arrival: since its X-Request-Start stamp, if it holds one
    this host's clock can use, else since the worker took it."""
    since_taken = (time.monotonic() - received) * 1e3
    stamp = headers.get(ARRIVAL)
    if stamp is None:
        return since_taken
    try:
        value = float(stamp.strip().removeprefix("t="))
    except ValueError:
        return since_taken
    if not math.isfinite(value) or value <= 0:
        return since_taken
    seconds = value / 1e6 if value > 1e14 else value / 1e3 if value > 1e11 else value
    return max(since_taken, (time.time() - seconds) * 1e3)
