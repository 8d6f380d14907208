"""A running catalog engine's catalog replaced in place (Runtime.swap, slm_core.catalog_store,
slm_core.serve.catalog_watch), on CPU with the random Qwen3 (fp32, eager): after a swap the engine
answers as an engine built on the new catalog, whether the catalog fits its buffers (copied in) or
not (new buffers); a call that a swap overtakes runs wholly on the new catalog; the store's
versions, activations and rollbacks; a worker's watch that swaps, refuses a broken version and
keeps serving."""

import logging
import random
import time

import numpy as np
import pytest
import torch
from helpers import engine_for, write_catalog

from slm_core.api import Engine
from slm_core.catalog_store import ARCHIVE, CatalogStore
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.errors import SpecError
from slm_core.item_trie import ItemTrie
from slm_core.serve.catalog_watch import HEADROOM, CatalogWatch
from slm_core.serve.runtime import Runtime

TASK = {"task": "beam", "beam_width": 6, "new_tokens": 3, "stop": ["<|im_end|>"], "max_batch": 4, "max_exclude": 4}
PROMPTS = ["a small language model", "search engines rank", "the quick brown fox"]


def _catalogs() -> dict[str, dict[str, list[int]]]:
    """ "a": 40 items of 1-3 tokens; "b": every other item of "a" and 6 new ones (fits a's buffers);
    "c": 120 items (more edges per level than a's buffers hold)."""
    rng = random.Random(5)
    seqs: list[tuple[int, ...]] = []
    while len(seqs) < 170:
        item = tuple(rng.randrange(10, 200) for _ in range(rng.randint(1, 3)))
        if item not in seqs:
            seqs.append(item)
    a = {f"item-{k}": list(s) for k, s in enumerate(seqs[:40])}
    b = {k: v for n, (k, v) in enumerate(a.items()) if n % 2} | {f"new-{k}": list(s) for k, s in enumerate(seqs[40:46])}
    c = {f"c-{k}": list(s) for k, s in enumerate(seqs[46:166])}
    return {"a": a, "b": b, "c": c}


CATALOGS = _catalogs()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, random_checkpoint):
    """The checkpoint, each catalog's JSONL and an engine built on each."""
    folder, _ = random_checkpoint("qwen3")
    ckpt = load_checkpoint(folder)
    root = tmp_path_factory.mktemp("catalogs")
    files, engines = {}, {}
    for name, items in CATALOGS.items():
        files[name] = root / f"{name}.jsonl"
        write_catalog(files[name], list(items.values()), list(items))
        engines[name] = engine_for(ckpt, **TASK, catalog=str(files[name]))
    return {"ckpt": ckpt, "files": files, "engines": engines, "root": root}


def fresh(setup, name: str = "a") -> Engine:
    """An engine on catalog `name` with a following worker's room for the next (HEADROOM)."""
    built = setup["engines"][name]
    return Engine(built.graph, built.task, "cpu", headroom=HEADROOM)


def saved(setup, name: str):
    """Catalog `name`'s trie as a store holds it."""
    path = setup["root"] / f"{name}.safetensors"
    setup["engines"][name].task.catalog.save(path)
    return path


def answers(engine, requests: list[dict]) -> list[dict]:
    """Each request's answer, all in one call, without the version that answered."""
    out = []
    for r in engine.run([engine.task.request(q) for q in requests]):
        answer = dict(r.answer)
        answer.pop("catalog_version")
        out.append(answer)
    return out


# the last excludes ids of a only (item-0, item-2), of b only (new-0) and of neither
REQUESTS = [{"prompt": p} for p in PROMPTS] + [{"prompt": PROMPTS[0], "exclude": ["item-0", "item-2", "new-0", "nope"]}]


def test_padded_graph_arrays_change_no_answer(setup):
    """The buffers hold a quarter more edges per level than the catalog (padding nodes without
    children, padding edges no node covers): the answers are those of the exact arrays."""
    eng = fresh(setup)
    exact = eng.task.catalog.graph_arrays()
    assert [len(c) for c in eng.constants] == eng.task.constant_capacity(HEADROOM)
    assert any(len(c) > len(a) for c, a in zip(eng.constants, exact))
    padded = list(eng.constants)
    eng.constants = tuple(torch.from_numpy(a) for a in exact)
    try:
        want = answers(eng, REQUESTS)
    finally:
        eng.constants = tuple(padded)
    assert answers(eng, REQUESTS) == want
    assert answers(setup["engines"]["a"], REQUESTS) == want  # an engine without room: exact arrays
    sizes = [len(c) for c in eng.constants]
    assert (
        eng.task.catalog.graph_arrays([len(a) - 1 if i == 2 else s for i, (a, s) in enumerate(zip(exact, sizes))])
        is None
    )


def test_a_swapped_catalog_answers_as_an_engine_built_on_it(setup):
    eng = fresh(setup)
    before = [len(c) for c in eng.constants]
    old = eng.task
    new = old.with_data(saved(setup, "b"), "v2")
    # only the catalog is new: a worker loads it beside its calls, without building a tokenizer again
    assert new.tokenizer is old.tokenizer and new.catalog is not old.catalog
    assert (old.data_version, old.catalog.size, new.catalog.size) == ("archive", len(CATALOGS["a"]), len(CATALOGS["b"]))
    # b fits a's buffers: copied in place
    assert eng.swap(new) is True
    assert [len(c) for c in eng.constants] == before
    assert answers(eng, REQUESTS) == answers(setup["engines"]["b"], REQUESTS)
    (result,) = eng.run([eng.task.request({"prompt": PROMPTS[0]})])
    assert result.answer["catalog_version"] == "v2" and result.stats.data_version == "v2"
    assert {c["id"] for c in result.answer["candidates"]} <= set(CATALOGS["b"])
    # c does not: new buffers, sized for it
    assert eng.swap(eng.task.with_data(saved(setup, "c"), "v3")) is False
    assert [len(c) for c in eng.constants] == setup["engines"]["c"].task.constant_capacity(HEADROOM) != before
    assert answers(eng, REQUESTS) == answers(setup["engines"]["c"], REQUESTS)
    # and back to the archive's own
    eng.swap(setup["engines"]["a"].task)
    assert answers(eng, REQUESTS) == answers(setup["engines"]["a"], REQUESTS)


def test_a_call_overtaken_by_a_swap_runs_wholly_on_the_new_catalog(setup, monkeypatch):
    """A swap between a call's CPU work (its exclusion rows, outside the lock) and its graph call:
    the call's rows, answers and ids are all the new catalog's."""
    eng = fresh(setup)
    new = eng.task.with_data(saved(setup, "b"), "v2")
    rows = Runtime._rows
    swapped = []

    def swap_first(task, values, encoded):
        if not swapped:
            swapped.append(eng.swap(new))
        return rows(task, values, encoded)

    monkeypatch.setattr(eng, "_rows", swap_first)
    request = REQUESTS[-1]  # excludes ids of both catalogs and one of neither
    (result,) = eng.run([eng.task.request(request)])
    assert swapped == [True]
    want = setup["engines"]["b"].run_one(setup["engines"]["b"].task.request(request))
    assert result.answer["candidates"] == want["candidates"]
    assert result.answer["unknown_exclude"] == want["unknown_exclude"] == 3  # item-0, item-2 and nope: not in b
    assert result.answer["catalog_version"] == "v2"


def test_a_catalog_beyond_the_tasks_bounds_is_refused_and_the_old_one_serves_on(setup, tmp_path):
    eng = fresh(setup)
    other = ItemTrie.build(["x", "y"], [[10, 11, 12, 13], [14]], [1, 2], [2], 4, 100)  # 4 tokens: new_tokens 3
    other.save(tmp_path / "four.safetensors")
    with pytest.raises(SpecError, match="another new_tokens or stop tokens"):
        eng.task.with_data(tmp_path / "four.safetensors", "v9")
    assert answers(eng, REQUESTS[:1]) == answers(setup["engines"]["a"], REQUESTS[:1])


def test_the_store_keeps_versions_and_rolls_back_in_order(setup, tmp_path):
    store = CatalogStore(tmp_path / "store")
    assert store.current() == ARCHIVE and store.stack() == []
    with pytest.raises(SpecError, match="nothing to roll back"):
        store.rollback()
    trie = setup["engines"]["b"].task.catalog
    for version in ("v1", "v2"):
        store.publish(trie, version)
    assert store.versions() == ["v1", "v2"] and store.current() == ARCHIVE  # published, not served
    for bad, message in (
        ("v1", "never rewritten"),
        ("../x", "a version is"),
        ("", "a version is"),
        (ARCHIVE, "archive"),
    ):
        with pytest.raises(SpecError, match=message):
            store.publish(trie, bad)
    with pytest.raises(SpecError, match="no catalog version 'v3'"):
        store.activate("v3")
    store.activate("v1")
    store.activate("v2")
    assert store.current() == "v2"
    assert store.rollback() == "v1" and store.current() == "v1"
    assert store.rollback() == ARCHIVE and store.current() == ARCHIVE
    store.activate("v2")
    assert store.stack() == ["v2"]
    assert ItemTrie.load(store.file("v2")).ids.tolist() == trie.ids.tolist()
    assert not [p for p in (tmp_path / "store" / "versions").iterdir() if p.name.startswith(".")]  # no staging left


def test_a_watch_swaps_the_active_version_refuses_a_broken_one_and_rolls_back(setup, tmp_path, caplog):
    eng = fresh(setup)
    store = CatalogStore(tmp_path / "store")
    watch = CatalogWatch(eng, store)
    assert watch.poll() is False and watch.version == ARCHIVE  # nothing active: the archive's
    store.publish(setup["engines"]["b"].task.catalog, "v2")
    store.activate("v2")
    assert watch.poll() is True and watch.version == "v2" and watch.swapped_at is not None
    assert answers(eng, REQUESTS) == answers(setup["engines"]["b"], REQUESTS)
    assert watch.poll() is False  # served already
    # a version whose file is broken: logged, not served, not tried again until CURRENT changes
    store.publish(setup["engines"]["c"].task.catalog, "v3")
    store.file("v3").write_bytes(b"not a trie")
    store.activate("v3")
    with caplog.at_level(logging.ERROR):
        assert watch.poll() is False
    assert "catalog version v3" in caplog.text and watch.version == "v2"
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert watch.poll() is False
    assert caplog.text == ""  # not tried again
    assert answers(eng, REQUESTS) == answers(setup["engines"]["b"], REQUESTS)
    store.rollback()  # v2 again
    assert watch.poll() is False and watch.version == "v2"
    store.rollback()  # the archive's own
    assert watch.poll() is True and watch.version == ARCHIVE
    assert answers(eng, REQUESTS) == answers(setup["engines"]["a"], REQUESTS)


def test_a_watch_thread_follows_the_store(setup, tmp_path):
    eng = fresh(setup)
    store = CatalogStore(tmp_path / "store")
    watch = CatalogWatch(eng, store, poll_s=0.05).start()
    try:
        store.publish(setup["engines"]["b"].task.catalog, "v2")
        store.activate("v2")
        for _ in range(200):
            if watch.version == "v2":
                break
            time.sleep(0.05)
        assert watch.version == "v2"
    finally:
        watch.stop()
    assert np.array_equal(eng.task.catalog.vocab, setup["engines"]["b"].task.catalog.vocab)
