"""Effective MFU, as the MFU formula defines it: each precision's logical matrix FLOPs (a task
counts a request's: Task.flops, slm_core.flops) against that precision's dense peak."""

PEAK = {"bf16": 989e12, "fp8": 1979e12}  # H200 dense peaks, FLOP/s


def mfu(qps: float, flops_per_request: float, precision: str = "bf16") -> float:
    return qps * flops_per_request / PEAK[precision]


def mfu_effective(qps: float, flops_per_request: float, fp8_per_request: float = 0.0) -> float:
    """Each precision's FLOPs against that precision's dense peak."""
    return qps * ((flops_per_request - fp8_per_request) / PEAK["bf16"] + fp8_per_request / PEAK["fp8"])
