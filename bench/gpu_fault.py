"""A fatal GPU fault on purpose: one Triton kernel stores far outside any allocation, an illegal
memory access. bench.reliability's gpu-fault step runs it beside the served workers, to record
what such a fault in one process does to the others on the GPU (under NVIDIA MPS, every client
of the GPU is reached) and how the deployment recovers.

    python -m bench.gpu_fault    # prints the launch time, then the error; exits 1 once it faulted
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _store_far(ptr, offset):
    tl.store(ptr + offset, 1.0)


def main() -> None:
    x = torch.zeros(1, device="cuda")
    _store_far[(1,)](x, 0)  # compiled and launched once in bounds, so the launch below is the fault
    torch.cuda.synchronize()
    # 2**40 floats (4 TiB) past a fresh allocation: no mapped page there
    print(f"launched at {time.time():.6f}", flush=True)
    _store_far[(1,)](x, 2**40)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"faulted: {e}".splitlines()[0], flush=True)
        raise SystemExit(1) from None
    raise SystemExit("no fault: the store went through")


if __name__ == "__main__":
    main()
