"""The requests a worker process holds, where a drain can see them: TorchServe counts a request
as pending only until a worker takes it (jobQueueStatus.pendingRequests), so a call that runs
longer than a drain's quiet period would look finished. While a worker handles a batch, a file
named for its process and the batch (holding the batch's request count) stands in a directory
that deploy/drain.py reads: SLM_IN_FLIGHT_DIR, else slm-in-flight in the temporary directory,
which serve.sh gives every process of a replica (TMPDIR).
"""

import contextlib
import itertools
import os
import tempfile
from pathlib import Path

ENV = "SLM_IN_FLIGHT_DIR"
_batches = itertools.count()


def directory() -> Path:
    return Path(os.environ.get(ENV) or Path(tempfile.gettempdir()) / "slm-in-flight")


@contextlib.contextmanager
def holding(requests: int):
    """Mark `requests` requests in flight in this process for the block. A directory that cannot
    be written leaves them unmarked: serving goes on, only a drain cannot wait for them."""
    path = directory() / f"{os.getpid()}-{next(_batches)}"
    try:
        try:
            path.write_text(str(requests))
        except FileNotFoundError:  # the first batch of the replica: no directory yet
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(requests))
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
