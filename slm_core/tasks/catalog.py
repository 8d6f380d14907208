"""Generative retrieval: beam search constrained to a catalog of items (slm_core.item_trie). Each step
allows a beam only the continuations of its trie node (and a stop token where an item ends), so
every candidate completes an item and is answered with the item's id. As transformers'
generate(..., prefix_allowed_tokens_fn=<the same trie>) ranks them; fewer than W candidates where
the catalog holds fewer.

A request may also `exclude` item ids (sold out, already shown): the search runs as if the
catalog did not hold them (with catalog_scores "catalog" their tokens still count in the
normaliser, which is the catalog's). Ids the catalog does not hold are ignored and counted in the
answer. A task with two stop tokens answers an item once per stop it can end on, as transformers
does.

A running worker may swap its catalog for another version within the task's bounds
(`with_data`, slm_core.serve.catalog_watch): the task is immutable, so a swap is a new task,
and each answer names the version that answered it (`catalog_version`; "archive": the catalog
built into the archive). A request's ids are looked up by the task that runs its call, so a
request is answered wholly by one catalog.
"""

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from slm_core import flops
from slm_core.errors import InputError, SpecError, json_type
from slm_core.item_trie import CATALOG, ItemTrie
from slm_core.spec import ModelSpec, TaskSpec
from slm_core.tasks.base import Difference, Tensor
from slm_core.tasks.beam import BeamRequest, BeamTask

BUILT_IN = "archive"  # the version name of the catalog built into the archive


@dataclass(frozen=True)
class CatalogRequest(BeamRequest):
    exclude: tuple[str, ...] = ()  # item ids, looked up in the catalog of the call that runs it


class CatalogTask(BeamTask):
    graph = "catalog"
    answer = ("candidates",)
    options_fields = ("beam_width", "new_tokens", "top", "exclude")

    def __init__(self, spec: TaskSpec, tokenizer: Tokenizer, version: str = BUILT_IN):
        super().__init__(spec, tokenizer)
        self.data_version = version
        self.catalog = self._load_catalog(spec)

    def _load_catalog(self, spec: TaskSpec) -> ItemTrie:
        """spec.catalog as a trie, checked against this task's bounds, new_tokens and stop tokens."""
        path = Path(spec.catalog)
        if path.suffix == ".safetensors":  # a package's or a store's, built already
            catalog = ItemTrie.load(path)
        else:
            catalog = ItemTrie.from_jsonl(
                path,
                self.tokenizer.tokenizer,
                self.stop_ids,
                spec.new_tokens,
                self.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True),
                spec.max_items,
                spec.max_trie_nodes,
            )
        if catalog.max_tokens != spec.new_tokens or catalog.vocab[: catalog.stop_count].tolist() != self.stop_ids:
            raise SpecError(f"catalog {path} was built for another new_tokens or stop tokens: rebuild it")
        for what, have, bound in (
            ("items", catalog.size, spec.max_items),
            ("trie nodes", catalog.nodes, spec.max_trie_nodes),
        ):
            if have > bound:
                raise SpecError(f"catalog {path} has {have} {what}, over the task's bound {bound}")
        return catalog

    @classmethod
    def matches(cls, spec) -> bool:
        return spec.task == cls.kind and spec.catalog is not None

    def with_data(self, path: "str | Path", version: str) -> "CatalogTask":
        """This task over another catalog (a trie file written by ItemTrie.save), named `version`;
        SpecError where it breaks the task's bounds, new_tokens or stop tokens."""
        spec = replace(self.spec, catalog=str(path))
        catalog = self._load_catalog(spec)
        # Everything but the catalog is this task's (a task is not changed once built): a running
        # worker loads the catalog in a thread beside its calls, and building the tokenizer again
        # there would hold the GIL for about a second.
        task = copy.copy(self)
        task.spec, task.catalog, task.data_version = spec, catalog, version
        return task

    # --- a request's settings --------------------------------------------------------------------
    def settings(self, payload: dict) -> CatalogRequest:
        base = super().settings(payload)
        exclude = payload.get("exclude", [])
        bound = self.spec.max_exclude
        if not isinstance(exclude, list) or not all(
            isinstance(i, (str, int)) and not isinstance(i, bool) for i in exclude
        ):
            raise InputError(
                f"'exclude' must be an array of item ids, got {json_type(exclude)}"
                if not isinstance(exclude, list)
                else "'exclude' must hold item ids (strings or integers)"
            )
        if len(exclude) > bound:
            raise InputError(
                f"'exclude' holds {len(exclude)} ids, over max_exclude={bound}", bound="max_exclude", limit=bound
            )
        return CatalogRequest(base.prompt, base.beam_width, base.new_tokens, base.top, tuple(map(str, exclude)))

    def value(self, value: Any) -> CatalogRequest:
        if isinstance(value, CatalogRequest):
            return value
        if isinstance(value, BeamRequest):
            return CatalogRequest(value.prompt, value.beam_width, value.new_tokens, value.top)
        return CatalogRequest(value)

    @property
    def option_columns(self) -> int:
        return 2 + 2 * self.new_tokens * self.spec.max_exclude

    def options(self, value: Any) -> list[int]:
        """Beam width, new tokens, then the exclusion as slm_core.item_trie.ItemTrie.exclusion gives it
        (CPU work: the runtime asks for it before its lock)."""
        value = self.value(value)
        row = super().options(value)
        excluded, _ = self.catalog.lookup(list(value.exclude))
        killed, stopped = self.catalog.exclusion(excluded, row[1], self.spec.max_exclude)
        return row + killed.ravel().tolist() + stopped.ravel().tolist()

    def write_data(self, package: Path) -> TaskSpec:
        self.catalog.save(package / CATALOG)
        return replace(self.spec, catalog=CATALOG)

    def graph_constants(self, sizes: list[int] | None = None) -> list[torch.Tensor] | None:
        arrays = self.catalog.graph_arrays(sizes)
        return None if arrays is None else [torch.from_numpy(a) for a in arrays]

    def constant_capacity(self, headroom: float) -> list[int]:
        return self.catalog.capacity(headroom, self.constant_bounds())

    def constant_bounds(self) -> list[int]:
        vocab, nodes = self.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True), self.spec.max_trie_nodes
        return [vocab + 2] + [nodes + 3, nodes + 2, vocab + 2] * self.new_tokens

    def extra_inputs(self) -> list[str]:
        e, n = self.spec.max_exclude, self.new_tokens
        return [
            f"options int32 [prompts, {self.option_columns}]: beam width, new tokens, excluded edges [{n}, {e}] "
            f"and item ends [{n}, {e}]",
            "vocab int32 [catalog tokens]: the stop tokens first",
            *(f"level{d} first int32 [nodes + 1], edges int32 [edges, 3], slots int32 [fan-out]" for d in range(n)),
        ]

    # --- answers ---------------------------------------------------------------------------------
    def unpack(self, outputs: list[list], first: int, count: int, value: Any = None) -> dict[str, Any]:
        value = self.value(value)
        items = outputs[3][first]  # best first, as the candidates kept
        candidates = [
            {"id": self.catalog.item_id(item), **c}
            for c, item in zip(super().unpack(outputs, first, count, value), items)
        ]
        answer: dict[str, Any] = {"candidates": candidates}
        if value.exclude:
            answer["unknown_exclude"] = self.catalog.lookup(list(value.exclude))[1]
        answer["catalog_version"] = self.data_version
        return answer

    def body(self, answer: dict[str, Any]) -> dict:
        return answer

    def v2_inputs(self) -> list[Tensor]:
        return [*super().v2_inputs(), Tensor("exclude", "BYTES", (-1,), optional=True)]

    def v2_outputs(self) -> list[Tensor]:
        """A beam's candidates with each one's item id, and how many excluded ids the catalog
        lacks (where the request excluded any)."""
        return [
            Tensor("id", "BYTES", (-1,), "candidates", "id"),
            *super().v2_outputs(),
            Tensor("unknown_exclude", "INT64", (1,), optional=True),
            Tensor("catalog_version", "BYTES", (1,)),
        ]

    def outputs(self) -> list[str]:
        return super().outputs() + [f"items int64 [prompts, {self.width}]: the item each candidate completes"]

    def constants(self) -> dict:
        return {
            "stop_ids": self.stop_ids,
            "catalog": {"file": CATALOG, **self.catalog.summary()},
            "scores": self.spec.catalog_scores,
        }

    def difference(self, want: dict, got: dict) -> Difference:
        return super().difference(want["candidates"], got["candidates"])

    def flops(self, model: ModelSpec, value: Any, precision: str) -> tuple[int, int]:
        total, fp8 = super().flops(model, value, precision)
        if self.spec.catalog_scores == "catalog":  # the LM head over the catalog's tokens only
            rows = self.head_rows(value)
            total -= flops.head_flops(model, rows, model.vocab_size) - flops.head_flops(
                model, rows, len(self.catalog.vocab)
            )
        return total, fp8
