"""A catalog's items as a trie, for generative retrieval: each item an id and the token ids the model writes
for it (a semantic ID, a title), as a prefix trie flattened into fixed-layout arrays.

    catalog = ItemTrie.from_jsonl(path, tokenizer, stop_ids, max_tokens, vocab_size, max_items, max_nodes)
    catalog.save(dir / CATALOG); ItemTrie.load(dir / CATALOG)   # what an archive holds and a worker reads

The trie is stored level by level: level d holds the edges from the nodes at depth d to those at
depth d+1, and the node an edge leads to is numbered by the edge (the root is node 0 of depth 0).
Per level, for the graph (slm_core.compile.catalog_graph):
- `first` [nodes + 1] int32: node u's children are the edges first[u] .. first[u+1]-1, sorted by
  token (CSR);
- `edges` [edges, 3] int32: the edge's token as an index into `vocab`, the item its node completes
  (-1: none) and `reach`, the fewest tokens of an item below it (items shorter than a request's
  new_tokens can still be reached through it);
- `slots` [F] int32: 0 .. F-1, F the level's largest fan-out (a graph input, so F is a size).
Every level holds at least two edges and F >= 2 (padding edges no range covers): a size of 1
would specialise the compiled graph, and a catalog swapped in later may differ.

`vocab` [V'] int32 lists the token ids the catalog uses, the stop tokens first. Items are kept in
the trie's sorted order: an item's index is its rank in it, and each node's items form one run of
that order, which is what the per-request exclusion (`exclusion`) counts on the CPU.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slm_core.errors import SpecError, json_type

CATALOG = "catalog.safetensors"  # in a package
NO_ITEM = -1
FAR = np.int32(1 << 20)  # a padding edge's reach: beyond every new_tokens
PADDING_EDGE = np.array([[0, NO_ITEM, FAR]], dtype=np.int32)  # vocab index 0, no item, unreachable


@dataclass(frozen=True)
class Level:
    first: np.ndarray  # [nodes + 1] int32
    edges: np.ndarray  # [edges, 3] int32: vocab index, item or -1, reach
    start: np.ndarray  # [edges] int64: the first item (in sorted order) under each edge's node
    end: np.ndarray  # [edges] int64: one past its last

    @property
    def fanout(self) -> int:
        return max(2, int(np.diff(self.first).max(initial=0)))


class ItemTrie:
    def __init__(
        self,
        ids: np.ndarray,
        tokens: np.ndarray,
        lengths: np.ndarray,
        levels: list[Level],
        vocab: np.ndarray,
        stop_count: int,
    ):
        self.ids = ids  # [items] bytes (UTF-8), in sorted order
        self.tokens = tokens  # [items, max_tokens] int32, -1 after the item's end
        self.lengths = lengths  # [items] int32
        self.levels = levels
        self.vocab = vocab  # [V'] int32, the stop tokens first
        self.stop_count = stop_count
        self._order = np.argsort(ids, kind="stable")  # for id lookups
        self._sorted_ids = ids[self._order]
        # items of at most n tokens before each item index, n = 1 .. max_tokens: [max_tokens, items + 1]
        self._short = np.zeros((tokens.shape[1], len(ids) + 1), dtype=np.int32)
        for n in range(1, tokens.shape[1] + 1):
            np.cumsum(lengths <= n, out=self._short[n - 1, 1:])

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def max_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def nodes(self) -> int:
        """Trie nodes below the root."""
        return sum(int(np.count_nonzero(level.end > level.start)) for level in self.levels)

    def summary(self) -> dict:
        return {
            "items": self.size,
            "trie_nodes": self.nodes,
            "tokens": int(len(self.vocab) - self.stop_count),
            "fanout": [level.fanout for level in self.levels],
            "item_tokens": [int(self.lengths.min()), int(self.lengths.max())],
            "graph_bytes": sum(a.nbytes for a in self.graph_arrays()),
        }  # on the graph's device

    def item_id(self, index: int) -> str:
        return self.ids[index].decode("utf-8")

    # --- building -------------------------------------------------------------------------------
    @classmethod
    def from_jsonl(
        cls,
        path: "str | Path",
        tokenizer,
        stop_ids: list[int],
        max_tokens: int,
        vocab_size: int,
        max_items: int,
        max_nodes: int,
    ) -> "ItemTrie":
        """A JSONL catalog, one item a line: {"id": ..., "tokens": [...]} or {"id": ..., "text": ...}
        (text tokenized without special tokens). SpecError naming the line for what it cannot hold."""
        ids, rows, lines, texts = [], [], [], {}
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"catalog {path} line {number}"
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecError(f"{where}: not JSON ({e.msg})") from None
                except ValueError as e:  # an integer past Python's digit limit
                    raise SpecError(f"{where}: {e}") from None
                if (
                    not isinstance(item, dict)
                    or set(item) - {"id", "tokens", "text"}
                    or "id" not in item
                    or ("tokens" in item) == ("text" in item)
                ):
                    raise SpecError(
                        f'{where}: an item is {{"id": ..., "tokens": [...]}} or {{"id": ..., "text": "..."}}'
                    )
                if not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool) or item["id"] == "":
                    raise SpecError(
                        f"{where}: 'id' must be a non-empty string or an integer, got {json_type(item['id'])}"
                    )
                _check_id(str(item["id"]), where)
                if "text" in item:
                    if not isinstance(item["text"], str) or not item["text"]:
                        raise SpecError(f"{where}: 'text' must be a non-empty string")
                    if not _utf8(item["text"]):
                        raise SpecError(f"{where}: 'text' holds a lone surrogate, which UTF-8 cannot carry")
                    texts[len(rows)] = item["text"]
                    rows.append(None)
                else:
                    tokens = item["tokens"]
                    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
                        raise SpecError(f"{where}: 'tokens' must be a non-empty array of token ids")
                    rows.append(tokens)
                ids.append(str(item["id"]))
                lines.append(number)
                if len(ids) > max_items:
                    raise SpecError(f"{where}: the catalog holds more than max_items={max_items} items")
        if not ids:
            raise SpecError(f"catalog {path} holds no item")
        if texts:
            encoded = tokenizer.encode_batch_fast(list(texts.values()), add_special_tokens=False)
            for i, enc in zip(texts, encoded):
                if not enc.ids:
                    raise SpecError(f"catalog {path} line {lines[i]}: its text encodes to no token")
                rows[i] = enc.ids
        stop_set = set(stop_ids)
        for i, row in enumerate(rows):
            where = f"catalog {path} line {lines[i]}"
            if len(row) > max_tokens:
                raise SpecError(f"{where}: the item is {len(row)} tokens, over new_tokens={max_tokens}")
            if min(row) < 0 or max(row) >= vocab_size:
                raise SpecError(
                    f"{where}: token {max(row) if max(row) >= vocab_size else min(row)} is outside "
                    f"the vocabulary (0 .. {vocab_size - 1})"
                )
            if stop_set.intersection(row):
                raise SpecError(
                    f"{where}: the item holds the stop token {sorted(stop_set.intersection(row))[0]}, "
                    "which ends a candidate"
                )
            if len(row) < max_tokens and not stop_set:
                raise SpecError(
                    f"{where}: the item is shorter than new_tokens={max_tokens}, and only a stop "
                    "token (task key 'stop') can end it"
                )
        return cls.build(ids, rows, lines, list(stop_ids), max_tokens, max_nodes, f"catalog {path}")

    @classmethod
    def build(
        cls,
        ids: list[str],
        rows: list[list[int]],
        lines: list[int],
        stop_ids: list[int],
        max_tokens: int,
        max_nodes: int,
        where: str = "catalog",
    ) -> "ItemTrie":
        seen: dict[str, int] = {}
        for item_id, line in zip(ids, lines):
            if item_id in seen:
                raise SpecError(f"{where} line {line}: id {item_id!r} is also on line {seen[item_id]}")
            seen[item_id] = line
        count = len(rows)
        matrix = np.full((count, max_tokens), -1, dtype=np.int32)
        for i, row in enumerate(rows):
            matrix[i, : len(row)] = row
        order = np.lexsort(matrix.T[::-1])  # lexicographic; a prefix (-1 after it) before its extensions
        matrix, lengths = matrix[order], (matrix[order] >= 0).sum(1).astype(np.int32)
        same = np.flatnonzero((matrix[1:] == matrix[:-1]).all(1))
        if same.size:
            a, b = sorted((lines[order[same[0]]], lines[order[same[0] + 1]]))
            raise SpecError(f"{where} line {b}: the item has the same tokens as line {a}")
        vocab = np.array(
            stop_ids + sorted(set(np.unique(matrix[matrix >= 0]).tolist()) - set(stop_ids)), dtype=np.int32
        )
        levels, parents_start = [], np.zeros(1, dtype=np.int64)  # the root: every item
        differs = np.zeros(count, dtype=bool)
        differs[0] = True
        for depth in range(1, max_tokens + 1):
            col = depth - 1
            differs[1:] |= matrix[1:, col] != matrix[:-1, col]
            inside = lengths >= depth
            starts = np.flatnonzero(inside & differs)
            # a node's run ends where its items do: at the next node, or at a shorter item
            runs_end = np.flatnonzero(inside[:-1] & ~(inside[1:] & ~differs[1:])) + 1
            runs_end = np.append(runs_end, count) if inside[-1] else runs_end
            ends = runs_end[np.searchsorted(runs_end, starts, side="right")]
            parent = np.searchsorted(parents_start, starts, side="right") - 1
            first = np.searchsorted(parent, np.arange(len(parents_start) + 1)).astype(np.int32)
            ends_item = lengths[starts] == depth
            reach = np.minimum.reduceat(np.where(inside, lengths, FAR), starts) if starts.size else starts
            edges = np.stack(
                [
                    np.searchsorted(vocab[len(stop_ids) :], matrix[starts, col]) + len(stop_ids),
                    np.where(ends_item, starts, NO_ITEM),
                    reach,
                ],
                axis=1,
            ).astype(np.int32)
            levels.append(_padded(first, edges, starts, ends, count))
            parents_start = np.append(starts, [count] * (levels[-1].edges.shape[0] - starts.size))
        if len(vocab) < 2:  # a graph size of 1 would specialise; a padding token would count in the scores
            raise SpecError(f"{where}: the catalog and the stop tokens use one token; a catalog needs two or more")
        catalog = cls(np.array([ids[i].encode("utf-8") for i in order]), matrix, lengths, levels, vocab, len(stop_ids))
        if catalog.nodes > max_nodes:
            raise SpecError(f"{where}: the trie has {catalog.nodes} nodes, over max_trie_nodes={max_nodes}")
        return catalog

    # --- files --------------------------------------------------------------------------------------
    def save(self, path: "str | Path") -> None:
        from safetensors.numpy import save_file

        arrays = {
            "id_bytes": np.ascontiguousarray(self.ids).view(np.uint8).reshape(self.size, -1),
            "tokens": self.tokens,
            "vocab": self.vocab,
            "stops": np.array([self.stop_count], dtype=np.int32),
        }
        for d, level in enumerate(self.levels):
            arrays.update(
                {f"first{d}": level.first, f"edges{d}": level.edges, f"start{d}": level.start, f"end{d}": level.end}
            )
        save_file(arrays, str(path))

    @classmethod
    def load(cls, path: "str | Path") -> "ItemTrie":
        from safetensors import safe_open

        # A running worker loads a catalog in a thread beside its calls, so the load holds the GIL
        # in short stretches: one array at a time (at 1M items, 12 ms at most; the whole file at
        # once holds it 40-80 ms), and the ids viewed as the worker holds them (NUL-padded to the
        # longest), not rebuilt one by one (most of a second).
        with safe_open(str(path), "np") as f:
            a = {name: f.get_tensor(name) for name in f.keys()}
        if "id_bytes" not in a:
            raise SpecError(f"{path} is not a catalog trie this version reads: publish or build it again")
        id_bytes = np.ascontiguousarray(a["id_bytes"])
        ids = id_bytes.view(f"S{id_bytes.shape[1]}").reshape(-1)
        tokens = a["tokens"]
        levels = [Level(a[f"first{d}"], a[f"edges{d}"], a[f"start{d}"], a[f"end{d}"]) for d in range(tokens.shape[1])]
        return cls(ids, tokens, (tokens >= 0).sum(1).astype(np.int32), levels, a["vocab"], int(a["stops"][0]))

    # --- the request path ----------------------------------------------------------------------
    def graph_arrays(self, sizes: list[int] | None = None) -> list[np.ndarray] | None:
        """The graph's catalog inputs: vocab, then per level first, edges, slots; with `sizes` (from
        capacity), each padded to that first dimension, or None where this catalog does not fit
        them. Padding changes no answer: vocab entries past the real ones are -1 (no column of
        the catalog's scores), nodes past the real ones have no children, edges past them are
        padding edges no node covers, slots past a node's fan-out are never valid."""
        out = [self.vocab]
        for level in self.levels:
            out += [level.first, level.edges, np.arange(level.fanout, dtype=np.int32)]
        if sizes is None:
            return out
        if len(sizes) != len(out) or any(len(a) > size for a, size in zip(out, sizes)):
            return None
        for i, (a, size) in enumerate(zip(out, sizes)):
            n = size - len(a)
            if i == 0:  # vocab
                pad = np.full(n, -1, dtype=np.int32)
            elif i % 3 == 1:  # first: the last node's end again (nodes without children)
                pad = np.full(n, a[-1], dtype=np.int32)
            elif i % 3 == 2:  # edges
                pad = np.tile(PADDING_EDGE, (n, 1))
            else:  # slots
                pad = np.arange(len(a), size, dtype=np.int32)
            out[i] = np.concatenate([a, pad])
        return out

    def capacity(self, headroom: float, bounds: list[int]) -> list[int]:
        """First dimensions of graph arrays that hold this catalog and, in place, later ones with up
        to `headroom` more tokens, edges per level (and the nodes they lead to) and fan-out per
        level, within `bounds` (the compiled graph's). A level's nodes are the edges of the level
        above it, so each `first` holds one more than the edges above."""
        sizes = [len(a) for a in self.graph_arrays()]
        for i in range(len(sizes)):
            if i % 3 != 1:  # vocab, edges, slots: one more than the share, for small fan-outs
                sizes[i] = max(sizes[i], min(bounds[i], math.ceil(sizes[i] * (1 + headroom)) + 1))
            elif i > 1:  # first, below the root's
                sizes[i] = max(sizes[i], min(bounds[i], sizes[i - 2] + 1))
        return sizes

    def lookup(self, item_ids: list[str]) -> tuple[list[int], int]:
        """The item indices of the distinct ids that are in the catalog, and how many distinct ids
        are not. An id longer than the catalog's longest (or not UTF-8) is not in it, and is never
        compared: a search casts the catalog's ids to the key's width."""
        width = self._sorted_ids.dtype.itemsize
        keys = {i.encode("utf-8") for i in set(item_ids) if _utf8(i)}
        fits = np.array(sorted(k for k in keys if len(k) <= width), dtype=self._sorted_ids.dtype)
        at = np.searchsorted(self._sorted_ids, fits)
        found = (at < self.size) & (self._sorted_ids[np.minimum(at, self.size - 1)] == fits)
        return sorted(self._order[at[found]].tolist()), len(set(item_ids)) - int(np.count_nonzero(found))

    def exclusion(self, items: list[int], new_tokens: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
        """A request's excluded items (indices) as the graph applies them, the catalog as if they
        were not in it for a request of `new_tokens`: per level, the edges whose node leads to no
        other item of at most new_tokens tokens ([max_tokens, slots], -1 padded), and per depth
        the nodes whose item is excluded, where a stop ends it ([max_tokens, slots])."""
        killed = np.full((self.max_tokens, slots), -1, dtype=np.int32)
        stopped = np.full((self.max_tokens, slots), -1, dtype=np.int32)
        through: dict[tuple[int, int], int] = {}
        for item in items:
            length = int(self.lengths[item])
            if length > new_tokens:
                continue  # this request cannot write it
            for depth in range(1, length + 1):
                key = (depth, self._node(item, depth))
                through[key] = through.get(key, 0) + 1
            stopped[length - 1, np.argmax(stopped[length - 1] < 0)] = self._node(item, length)
        short = self._short[new_tokens - 1]
        for (depth, node), gone in through.items():
            level = self.levels[depth - 1]
            if short[level.end[node]] - short[level.start[node]] == gone:
                row = killed[depth - 1]
                row[np.argmax(row < 0)] = node
        return killed, stopped

    def _node(self, item: int, depth: int) -> int:
        """The node at `depth` on the item's path: the last node of that depth starting at or before it."""
        return int(np.searchsorted(self.levels[depth - 1].start, item, side="right") - 1)


MAX_ID_BYTES = 256  # an item id's UTF-8 length: every worker holds ids x the longest


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _check_id(item_id: str, where: str) -> None:
    if not _utf8(item_id):
        raise SpecError(f"{where}: 'id' holds a lone surrogate, which UTF-8 cannot carry")
    if "\x00" in item_id:
        raise SpecError(f"{where}: 'id' holds a NUL character")
    if len(item_id.encode("utf-8")) > MAX_ID_BYTES:
        raise SpecError(f"{where}: 'id' is {len(item_id.encode('utf-8'))} bytes in UTF-8, over {MAX_ID_BYTES}")


def _padded(first: np.ndarray, edges: np.ndarray, starts: np.ndarray, ends: np.ndarray, items: int) -> Level:
    """A level with padding edges behind the real ones (no node's range covers them): one, or as
    many as make two edges. They lead to nodes without children or items (an empty run at the
    end of the order)."""
    pad = max(1, 2 - edges.shape[0])
    filler = np.tile(PADDING_EDGE, (pad, 1))
    empty = np.full(pad, items, dtype=np.int64)
    return Level(first, np.concatenate([edges, filler]), np.concatenate([starts, empty]), np.concatenate([ends, empty]))
