"""A catalog model's catalogs as versions in one directory that all its workers read: how a running
model's catalog is replaced in place, and rolled back (slm_core.serve.catalog_watch swaps it in
each worker; `slm-archiver publish|activate|rollback` write it).

    store = CatalogStore(DIR)
    store.publish(trie, "2026-12-05")   # versions/2026-12-05/, written once, never rewritten
    store.activate("2026-12-05")        # CURRENT names it: every worker serves it within a poll
    store.rollback()                    # CURRENT names the version active before it

Layout:
    DIR/versions/V/catalog.safetensors   a built trie (ItemTrie.save): workers load it as it is
    DIR/versions/V/summary.json          its ItemTrie.summary(), its source file and when
    DIR/CURRENT                          the version workers serve; "archive" (or no file): the
                                         catalog built into the archive
    DIR/HISTORY                          one JSON line per activation or rollback

A version is published whole (built beside its place, then renamed into it) and CURRENT is
replaced by a rename, so a worker reads the old version or the new one, never a part. The
activations form a stack: a rollback pops the current one and serves the one below it, down to
"archive".
"""

import json
import os
import re
import tempfile
import time
from pathlib import Path

from slm_core.errors import SpecError
from slm_core.item_trie import CATALOG, ItemTrie

ARCHIVE = "archive"  # the version name of the catalog built into the archive
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CatalogStore:
    def __init__(self, root: "str | Path"):
        self.root = Path(root)

    def file(self, version: str) -> Path:
        """A published version's trie file."""
        return self.root / "versions" / version / CATALOG

    def versions(self) -> list[str]:
        """The published versions, oldest first."""
        published = [p for p in (self.root / "versions").glob("*") if (p / CATALOG).is_file()]
        return [p.name for p in sorted(published, key=lambda p: p.stat().st_mtime)]

    def current(self) -> str:
        """The version the workers serve."""
        try:
            return (self.root / "CURRENT").read_text().strip() or ARCHIVE
        except FileNotFoundError:
            return ARCHIVE

    def publish(self, trie: ItemTrie, version: str, source: str = "") -> Path:
        """Write `trie` as `version` (not yet served: activate). SpecError for a name that is not
        a version's, or one published already."""
        check_version(version)
        if version == ARCHIVE:
            raise SpecError(f"version {ARCHIVE!r} names the archive's own catalog: choose another")
        target = self.root / "versions" / version
        if target.exists():
            raise SpecError(f"catalog version {version!r} is in {self.root} already: versions are never rewritten")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
        trie.save(staging / CATALOG)
        summary = {**trie.summary(), "source": source, "published": _now()}
        (staging / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:  # published meanwhile under the same name
            raise SpecError(
                f"catalog version {version!r} was published meanwhile: versions are never rewritten"
            ) from None
        return target

    def activate(self, version: str) -> None:
        """Serve `version` (published, or "archive") on every worker from their next poll."""
        if version != ARCHIVE and not self.file(version).is_file():
            raise SpecError(f"no catalog version {version!r} in {self.root} (published: {self.versions()})")
        self._serve(version, "activate")

    def rollback(self) -> str:
        """Serve the version active before the current one; returns it."""
        stack = self.stack()
        if not stack:
            raise SpecError(f"nothing to roll back in {self.root}: the archive's own catalog is served")
        version = stack[-2] if len(stack) > 1 else ARCHIVE
        self._serve(version, "rollback")
        return version

    def stack(self) -> list[str]:
        """The activations not rolled back, oldest first (the archive's catalog below them all)."""
        stack: list[str] = []
        try:
            lines = (self.root / "HISTORY").read_text().splitlines()
        except FileNotFoundError:
            return stack
        for line in lines:
            entry = json.loads(line)
            if entry["action"] == "rollback":
                stack.pop()
            else:
                stack.append(entry["version"])
        return stack

    def _serve(self, version: str, action: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "HISTORY", "a") as history:
            history.write(json.dumps({"action": action, "version": version, "time": _now()}) + "\n")
        staged = self.root / f".CURRENT-{os.getpid()}"
        staged.write_text(version + "\n")
        os.replace(staged, self.root / "CURRENT")


def check_version(version: str) -> None:
    if not VERSION.fullmatch(version):
        raise SpecError(
            f"catalog version {version!r}: a version is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
