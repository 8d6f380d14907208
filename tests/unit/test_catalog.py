"""Generative retrieval: the catalog's trie, its build errors, and catalog-constrained beams
against transformers' beam search with prefix_allowed_tokens_fn on the same weights (fp32, CPU),
with per-request width, new tokens, top and exclude."""

import random

import numpy as np
import pytest
from helpers import assert_same_beams, engine_for, hf_beam, hf_catalog_beam, text_ids, write_catalog

from slm_core.compile.checkpoint import load_checkpoint
from slm_core.errors import InputError, SpecError
from slm_core.item_trie import ItemTrie

CITIES = [
    "Paris",
    "Paris, Texas",
    "Rome",
    "Rome, Georgia",
    "Berlin",
    "London",
    "Madrid",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Dublin",
    "Oslo",
    "Athens",
    "Brussels",
    "Amsterdam",
    "Copenhagen",
    "Helsinki",
    "Stockholm",
    "Budapest",
]
CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _ref_catalog(cat: ItemTrie, items: list[tuple[int, ...]], n_tokens: int) -> None:
    """Every node of the flattened trie against a brute-force walk of the items."""
    vocab = cat.vocab

    def walk(prefix: list[int], depth: int, node: int) -> None:
        kids = sorted({i[depth] for i in items if len(i) > depth and list(i[:depth]) == prefix})
        if depth == n_tokens:
            assert not kids
            return
        level = cat.levels[depth]
        lo, hi = level.first[node], level.first[node + 1]
        assert [int(vocab[level.edges[e, 0]]) for e in range(lo, hi)] == kids
        for e in range(lo, hi):
            path = prefix + [int(vocab[level.edges[e, 0]])]
            item = level.edges[e, 1]
            assert (item >= 0) == (tuple(path) in items)
            assert level.edges[e, 2] == min(len(i) for i in items if list(i[: len(path)]) == path)
            walk(path, depth + 1, e)

    walk([], 0, 0)
    assert cat.nodes == len({i[:k] for i in items for k in range(1, len(i) + 1)})


def test_trie_and_exclusion_equal_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 4)
        items = list({tuple(rng.randint(1, 6) for _ in range(rng.randint(1, n))) for _ in range(rng.randint(1, 30))})
        cat = ItemTrie.build(
            [f"i{j}" for j in range(len(items))], [list(i) for i in items], list(range(len(items))), [0], n, 10**6
        )
        _ref_catalog(cat, items, n)
        for _ in range(4):  # the excluded edges: those that lead to no other item of <= new_tokens tokens
            limit, out = rng.randint(1, n), rng.sample(range(cat.size), rng.randint(0, min(4, cat.size)))
            killed, _ = cat.exclusion(out, limit, 8)
            left = [
                tuple(cat.tokens[k][: cat.lengths[k]])
                for k in range(cat.size)
                if k not in out and cat.lengths[k] <= limit
            ]
            for depth, level in enumerate(cat.levels):
                for e in np.flatnonzero(level.end > level.start):
                    prefix = tuple(cat.tokens[level.start[e]][: depth + 1])
                    alive = level.edges[e, 2] <= limit and e not in killed[depth]
                    assert alive == any(r[: depth + 1] == prefix for r in left)


def test_catalog_file_round_trip_and_lookup(tmp_path):
    cat = ItemTrie.build(["b", "a", "c"], [[3, 4], [3], [5, 6]], [1, 2, 3], [0], 2, 100)
    cat.save(tmp_path / "c.safetensors")
    again = ItemTrie.load(tmp_path / "c.safetensors")
    assert [again.item_id(i) for i in range(3)] == ["a", "b", "c"]  # the trie's order: [3] < [3, 4] < [5, 6]
    assert again.lookup(["c", "zz", "a", "c"]) == ([0, 2], 1)
    for x, y in zip(cat.graph_arrays(), again.graph_arrays()):
        assert np.array_equal(x, y)
    # ids of other byte lengths, one a prefix of another, multi-byte UTF-8: as they were, and found
    ids = ["sku-10", "sku-1", "café Ω", "x" * 40]
    cat = ItemTrie.build(ids, [[3], [4], [5], [6]], [1, 2, 3, 4], [0], 1, 100)
    cat.save(tmp_path / "d.safetensors")
    again = ItemTrie.load(tmp_path / "d.safetensors")
    assert [again.item_id(i) for i in range(4)] == ids
    assert again.lookup(["sku-1", "sku-10", "sku", "café Ω", "x" * 40, "x" * 41]) == ([0, 1, 2, 3], 2)
    # a file without the id matrix (another layout, another tool's): refused with what to do
    from safetensors.numpy import save_file

    save_file({"ids": np.frombuffer(b"ab", np.uint8).copy()}, str(tmp_path / "e.safetensors"))
    with pytest.raises(SpecError, match="publish or build it again"):
        ItemTrie.load(tmp_path / "e.safetensors")


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "holds no item"),
        (['{"id": "a", "tokens": [1, 2, 3, 4]}'], "line 1: the item is 4 tokens, over new_tokens=3"),
        (['{"id": "a", "tokens": [1]}', '{"id": "b", "tokens": [99999]}'], "line 2: token 99999 is outside"),
        (['{"id": "a", "tokens": [1]}', "", '{"id": "a", "tokens": [5]}'], "line 3: id 'a' is also on line 1"),
        (
            ['{"id": "a", "tokens": [1, 5]}', '{"id": "b", "tokens": [1, 5]}'],
            "line 2: the item has the same tokens as line 1",
        ),
        (['{"id": "a", "tokens": [1, 2]}'], "holds the stop token 2"),
        (['{"id": "a"}'], "line 1: an item is"),
        (['{"id": "a", "text": ""}'], "line 1: 'text' must be a non-empty string"),
        (["not json"], "line 1: not JSON"),
        (['{"id": "a\\u0000", "tokens": [5]}'], "line 1: 'id' holds a NUL character"),
        (['{"id": "\\ud800", "tokens": [5]}'], "line 1: 'id' holds a lone surrogate"),
        (['{"id": "%s", "tokens": [5]}' % ("x" * 257)], "line 1: 'id' is 257 bytes in UTF-8, over 256"),
        (['{"id": 1%s, "tokens": [5]}' % ("0" * 5000)], "catalog .* line 1: "),
        (['{"id": "a", "text": "\\udc80x"}'], "line 1: 'text' holds a lone surrogate"),
    ],
)
def test_bad_catalogs_are_build_errors_naming_the_line(tmp_path, random_checkpoint, lines, message):
    folder, _ = random_checkpoint("qwen2")
    ckpt = load_checkpoint(folder)
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    stop = "<|im_end|>"  # token 2
    with pytest.raises(SpecError, match=message):
        engine_for(ckpt, task="beam", beam_width=2, new_tokens=3, stop=[stop], catalog=str(tmp_path / "c.jsonl"))


def test_exclude_ids_that_cannot_match_cost_nothing_and_count_once(tmp_path, random_checkpoint):
    """An id longer than the catalog's longest, or one UTF-8 cannot carry, is unknown without a
    search (a search would widen every catalog id to its length); repeated ids count once."""
    folder, _ = random_checkpoint("qwen3")
    write_catalog(tmp_path / "c.jsonl", [[10, 11], [12], [13, 14]])
    eng = engine_for(
        load_checkpoint(folder),
        task="beam",
        beam_width=4,
        new_tokens=2,
        stop=["<|im_end|>"],
        catalog=str(tmp_path / "c.jsonl"),
    )
    request = eng.task.request({"prompt": "x", "exclude": ["item-1", "item-1", "zz", "zz", "\ud800", "y" * 10**7]})
    assert eng.task.catalog.lookup(list(request.exclude)) == (eng.task.catalog.lookup(["item-1"])[0], 3)
    answer = eng.run_one(request)
    assert answer["unknown_exclude"] == 3 and "item-1" not in {c["id"] for c in answer["candidates"]}


def test_repeated_stop_strings_count_once(tmp_path, random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    write_catalog(tmp_path / "c.jsonl", [[10, 11], [12]])
    eng = engine_for(
        load_checkpoint(folder),
        task="beam",
        beam_width=4,
        new_tokens=2,
        stop=["<|im_end|>", "<|im_end|>"],
        catalog=str(tmp_path / "c.jsonl"),
    )
    ids = [c["id"] for c in eng.run_one("x")["candidates"]]
    assert eng.task.stop_ids == [2] and sorted(ids) == ["item-0", "item-1"]


def test_a_catalog_of_one_token_is_refused(tmp_path, random_checkpoint):
    """One token (no stop): a graph size of 1 would specialise, and a padding token would count in
    catalog_scores: catalog's normaliser."""
    folder, _ = random_checkpoint("qwen2")
    write_catalog(tmp_path / "c.jsonl", [[5, 5, 5]])
    with pytest.raises(SpecError, match="use one token; a catalog needs two or more"):
        engine_for(load_checkpoint(folder), task="beam", beam_width=2, new_tokens=3, catalog=str(tmp_path / "c.jsonl"))


def test_short_items_need_a_stop_token(tmp_path, random_checkpoint):
    folder, _ = random_checkpoint("qwen2")
    write_catalog(tmp_path / "c.jsonl", [[5, 6], [5, 7, 8]])
    with pytest.raises(SpecError, match="shorter than new_tokens=3, and only a stop"):
        engine_for(load_checkpoint(folder), task="beam", beam_width=2, new_tokens=3, catalog=str(tmp_path / "c.jsonl"))


def _items(rng, count: int, n: int, vocab: range, prefixes: bool) -> list[list[int]]:
    items = {tuple(rng.choice(vocab) for _ in range(n)) for _ in range(count)}
    if prefixes:  # items that are prefixes of others
        items |= {i[: rng.randint(1, n - 1)] for i in list(items)[: count // 3]}
    return [list(i) for i in sorted(items)]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("count, width", [(40, 4), (5, 8), (300, 16)])  # larger and smaller than W
@pytest.mark.parametrize("scores", ["vocab", "catalog"])
def test_random_catalog_beam_equals_transformers(tmp_path, random_checkpoint, arch, count, width, scores):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    rng = random.Random(count)
    stop_id = 3
    items = _items(rng, count, 4, range(10, 200), prefixes=True)
    write_catalog(tmp_path / "c.jsonl", items)
    eng = engine_for(
        ckpt,
        task="beam",
        beam_width=width,
        new_tokens=4,
        stop=[ckpt.tokenizer.decode([stop_id])],
        catalog=str(tmp_path / "c.jsonl"),
        catalog_scores=scores,
    )
    assert eng.task.stop_ids == [stop_id]
    for prompt in ("a small language model", "search engines rank"):
        ours = eng.run_one(prompt)["candidates"]
        ref = hf_catalog_beam(hf, text_ids(eng, [prompt])[0], width, 4, [stop_id], items, scores)
        assert_same_beams(ours, ref)
        assert len(ours) == min(width, len(ref)) and len(ours) <= len(items)
        for c in ours:  # each candidate names the item it wrote
            tokens = [t for t in c["token_ids"] if t != stop_id]
            assert items[int(c["id"].split("-")[1])] == tokens


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_semantic_ids_without_a_stop_token(tmp_path, random_checkpoint, arch):
    """Items of exactly new_tokens tokens (semantic IDs, one level per token range) end by length."""
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    rng = random.Random(1)
    items = sorted({(rng.randrange(10, 40), rng.randrange(40, 70), rng.randrange(70, 100)) for _ in range(200)})
    write_catalog(tmp_path / "c.jsonl", [list(i) for i in items])
    eng = engine_for(ckpt, task="beam", beam_width=8, new_tokens=3, catalog=str(tmp_path / "c.jsonl"))
    prompt = "beam search keeps"
    ours = eng.run_one(prompt)["candidates"]
    assert_same_beams(ours, hf_catalog_beam(hf, text_ids(eng, [prompt])[0], 8, 3, [], [list(i) for i in items]))
    assert len(ours) == 8 and all(tuple(c["token_ids"]) in set(items) for c in ours)


def test_per_request_settings_and_exclude_equal_transformers_in_one_call(tmp_path, random_checkpoint):
    folder, hf = random_checkpoint("qwen3")
    ckpt = load_checkpoint(folder)
    rng = random.Random(7)
    stop_id = 3
    items = _items(rng, 60, 4, range(10, 120), prefixes=True)
    write_catalog(tmp_path / "c.jsonl", items)
    eng = engine_for(
        ckpt,
        task="beam",
        beam_width=8,
        new_tokens=4,
        stop=[ckpt.tokenizer.decode([stop_id])],
        catalog=str(tmp_path / "c.jsonl"),
        max_batch=4,
        max_exclude=8,
    )
    prompt = "a small language model"
    ids = text_ids(eng, [prompt])[0]
    full = hf_catalog_beam(hf, ids, 8, 4, [stop_id], items)
    shown = [c for c in eng.run_one(prompt)["candidates"]][:3]
    excluded = [c["id"] for c in shown] + ["not-an-item"]
    left = [i for k, i in enumerate(items) if f"item-{k}" not in excluded]
    requests = [
        {"prompt": prompt, "beam_width": 3, "new_tokens": 2},
        {"prompt": prompt, "exclude": excluded},
        {"prompt": prompt, "top": 2},
        {"prompt": prompt, "beam_width": 5, "new_tokens": 3, "exclude": excluded[:1]},
    ]
    results = eng.run([eng.task.request(r) for r in requests])
    assert {r.stats.batch for r in results} == {4}
    assert_same_beams(results[0].answer["candidates"], hf_catalog_beam(hf, ids, 3, 2, [stop_id], items))
    assert_same_beams(results[1].answer["candidates"], hf_catalog_beam(hf, ids, 8, 4, [stop_id], left))
    assert results[1].answer["unknown_exclude"] == 1
    assert not {c["id"] for c in results[1].answer["candidates"]} & set(excluded)
    assert_same_beams(results[2].answer["candidates"], full[:2])
    left1 = [i for k, i in enumerate(items) if f"item-{k}" != excluded[0]]
    assert_same_beams(results[3].answer["candidates"], hf_catalog_beam(hf, ids, 5, 3, [stop_id], left1))


def test_plain_beam_per_request_settings_equal_transformers(random_checkpoint):
    folder, hf = random_checkpoint("qwen2")
    ckpt = load_checkpoint(folder)
    eng = engine_for(ckpt, task="beam", beam_width=8, new_tokens=4, max_batch=3)
    prompt = "search engines rank"
    ids = text_ids(eng, [prompt])[0]
    results = eng.run(
        [
            eng.task.request(r)
            for r in (
                {"prompt": prompt, "beam_width": 2, "new_tokens": 3},
                {"prompt": prompt},
                {"prompt": prompt, "top": 3, "new_tokens": 1},
            )
        ]
    )
    assert_same_beams(results[0].answer, hf_beam(hf, ids, 2, 3, [], pad_id=0))
    assert_same_beams(results[1].answer, hf_beam(hf, ids, 8, 4, [], pad_id=0))
    assert_same_beams(results[2].answer, hf_beam(hf, ids, 8, 1, [], pad_id=0)[:3])


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "beam_width": 9}, "'beam_width' must be an integer from 1 to 8"),
        ({"prompt": "x", "new_tokens": 0}, "'new_tokens' must be an integer from 1 to 4"),
        ({"prompt": "x", "top": "3"}, "'top' must be an integer from 1 to 8 .*got a string"),
        ({"prompt": "x", "exclude": "a"}, "'exclude' must be an array of item ids, got a string"),
        ({"prompt": "x", "exclude": [None]}, "'exclude' must hold item ids"),
        ({"prompt": "x", "exclude": ["a"] * 9}, "over max_exclude=8"),
        ({"prompt": "x", "width": 3}, "unknown fields"),
    ],
)
def test_bad_settings_are_400s(tmp_path, random_checkpoint, body, message):
    folder, _ = random_checkpoint("qwen3")
    write_catalog(tmp_path / "c.jsonl", [[10, 11], [12]])
    eng = engine_for(
        load_checkpoint(folder),
        task="beam",
        beam_width=8,
        new_tokens=4,
        stop=["<|im_end|>"],
        catalog=str(tmp_path / "c.jsonl"),
        max_exclude=8,
    )
    with pytest.raises(InputError, match=message):
        eng.task.request(body)


def test_smollm2_catalog_of_titles_equals_transformers(tmp_path, smollm2):
    path, ckpt, hf, _ = smollm2
    write_catalog(tmp_path / "cities.jsonl", CITIES)
    for width in (4, 32):  # fewer and more beams than the catalog's 20 items
        eng = engine_for(
            ckpt,
            task="beam",
            beam_width=width,
            new_tokens=4,
            max_prompt_tokens=64,
            stop=["<|im_end|>"],
            prompt_template=CHAT,
            catalog=str(tmp_path / "cities.jsonl"),
        )
        items = [ckpt.tokenizer.encode(c, add_special_tokens=False).ids for c in CITIES]
        for prompt in ("What is the capital of France?", "Name a city in Italy"):
            ours = eng.run_one(prompt)["candidates"]
            assert_same_beams(
                ours,
                hf_catalog_beam(
                    hf, text_ids(eng, [prompt])[0], width, 4, eng.task.stop_ids, [i for i in items if len(i) <= 4]
                ),
            )
            assert all(c["text"] == CITIES[int(c["id"].split("-")[1])] for c in ours)


@pytest.mark.parametrize("scores", ["vocab", "catalog"])
def test_a_catalog_graph_exports_with_the_triton_row_top_k(tmp_path, random_checkpoint, scores):
    """A CUDA build's catalog graph selects with row_topk where a row's length is static; the
    continuations' row follows the catalog's fan-out, a dynamic size, and takes torch.topk (the
    op refuses a symbolic length: tracing its chunk plan through one never finished)."""
    from slm_core.compile.export import export_graph
    from slm_kernels.row_topk import row_topk

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    rng = random.Random(2)
    items = sorted({(rng.randrange(10, 40), rng.randrange(40, 70), rng.randrange(70, 100)) for _ in range(300)})
    write_catalog(tmp_path / "c.jsonl", [list(i) for i in items])
    eng = engine_for(
        ckpt, task="beam", beam_width=8, new_tokens=3, catalog=str(tmp_path / "c.jsonl"), catalog_scores=scores
    )
    eng.graph.row_topk = row_topk  # as BeamGraph.build sets it for the Triton kernels
    program = export_graph(eng.graph, eng.task)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("slm.row_topk.default") >= 3 and ops.count("aten.topk.default") == 3  # one per step
