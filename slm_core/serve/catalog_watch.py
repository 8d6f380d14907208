"""A worker that follows its model's catalog store (slm_core.catalog_store): when the store's
CURRENT names another version, the worker loads it beside the one it serves and swaps it in between
two calls (Runtime.swap). Nothing is recompiled; the calls go on meanwhile.

    watch = CatalogWatch(engine, CatalogStore(DIR))
    watch.poll()     # once, now (a worker's load: it serves CURRENT from its first request)
    watch.start()    # then every POLL_S, in a thread of its own

A version that fails to load (a broken file, a catalog beyond the task's bounds) is logged and
not tried again until CURRENT changes; the worker keeps serving what it served.
"""

import logging
import threading
import time

from slm_core.catalog_store import CatalogStore
from slm_core.serve.runtime import Runtime

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often a worker reads CURRENT (one small file)
# Room in a following worker's catalog buffers (Runtime's headroom): catalogs with up to this share
# more tokens, edges and fan-out per level than the one it loaded swap in place, without new CUDA graphs.
HEADROOM = 0.25


class CatalogWatch:
    def __init__(self, engine: Runtime, store: CatalogStore, poll_s: float = POLL_S):
        self.engine = engine
        self.store = store
        self.poll_s = poll_s
        self.archive = engine.task  # what "archive" serves: the catalog the worker loaded
        self.failed: str | None = None  # the version that failed to load, until CURRENT changes
        self.swapped_at: float | None = None  # time.time() of the last swap
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def version(self) -> str:
        return self.engine.task.data_version

    def poll(self) -> bool:
        """Swap in the store's current version if it is not the one served; whether it did."""
        try:
            version = self.store.current()
        except OSError as e:  # unreadable for now (a volume remounting): the next poll tries again
            log.error("reading the catalog store %s failed: %s", self.store.root, e)
            return False
        if version == self.version:
            self.failed = None
            return False
        if version == self.failed:
            return False
        start = time.perf_counter()
        try:
            if version == self.archive.data_version:
                task = self.archive
            else:
                task = self.engine.task.with_data(self.store.file(version), version)
            loaded = time.perf_counter()
            in_place = self.engine.swap(task)
        except Exception as e:  # the worker serves on with what it has
            self.failed = version
            log.error("catalog version %s of %s not served: %s", version, self.store.root, e)
            return False
        self.failed = None
        self.swapped_at = time.time()
        log.info(
            "serving catalog version %s: loaded in %.0f ms, swapped in %.0f ms (%s)",
            version,
            (loaded - start) * 1e3,
            (time.perf_counter() - loaded) * 1e3,
            "in place" if in_place else "new buffers, CUDA graphs captured again",
        )
        return True

    def start(self) -> "CatalogWatch":
        self._thread = threading.Thread(target=self._run, name="catalog-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()
