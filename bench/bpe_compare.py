"""tiktoken's BPE against the `tokenizers` library on a byte-level BPE tokenizer.json: speed per
call of 1 and 4 W1 requests (15 texts each), and whether the ids are equal, on every vocabulary
string and on random texts (real words, and mixed scripts, digits and punctuation) without the
tokenizer's added tokens. W1's handler time outside the graph is mostly this tokenizing.

tiktoken releases the GIL while it encodes, so a call's texts may also be split over a thread
pool (contiguous runs of about equal characters, one per thread); that is timed too.

The encoder is slm_core.fast_bpe's (which says when the two agree); it matches no added tokens.

    RAYON_NUM_THREADS=1 python -m bench.bpe_compare --tokenizer bench/assets/tokenizer.json [--threads 2]
"""

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

from bench.workloads import WORKLOADS, TextMaker
from slm_core.fast_bpe import FastBpe, byte_decoder

MIXED = list(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-_()[]{}#@&*/\\\n\t"
    "éüñßøåçœ日本語中文한국어🤖😀—–…«»€£¥"
)


def split_over(pool: ThreadPoolExecutor, k: int, enc, texts: list[str]) -> list[list[int]]:
    """Each text's ids, k contiguous runs of texts of about equal characters encoded by the pool's threads."""
    total = sum(map(len, texts))
    runs, run, seen = [], [], 0
    for t in texts:
        run.append(t)
        seen += len(t)
        if seen * k >= total * (len(runs) + 1):
            runs.append(run)
            run = []
    runs += [run] if run else []
    return [ids for part in pool.map(lambda r: [enc.encode_ordinary(t) for t in r], runs) for ids in part]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--random-texts", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=2, help="the thread pool's size for the split timing")
    args = p.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    config = json.loads(tok.to_str())
    fast = FastBpe(tok, config)
    print(f"slm_core.fast_bpe takes this tokenizer: {fast.usable}")
    if fast.encoding is None:
        return
    enc = fast.encoding

    requests = TextMaker(tok, seed=2).requests(WORKLOADS["W1"], 4)
    pool = ThreadPoolExecutor(args.threads)
    for n in (1, 4):
        texts = [t for r in requests[:n] for t in r["texts"]]
        runs = (
            ("tokenizers encode_batch_fast", lambda: tok.encode_batch_fast(texts, add_special_tokens=False)),
            ("tiktoken encode_ordinary, one text after another", lambda: [enc.encode_ordinary(t) for t in texts]),
            (
                f"tiktoken encode_ordinary over {args.threads} threads",
                lambda: split_over(pool, args.threads, enc, texts),
            ),
        )
        for name, run in runs:
            assert [list(ids) for ids in (e.ids if hasattr(e, "ids") else e for e in run())] == [
                enc.encode_ordinary(t) for t in texts
            ]
            timings = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(40):
                    run()
                timings.append((time.perf_counter() - start) / 40 * 1e3)
            print(f"{name}: {statistics.median(timings):.3f} ms per call of {n} W1 request(s)")

    decode = byte_decoder()
    specials = [t["content"] for t in config["added_tokens"]]
    spelled = {t: bytes(decode[c] for c in t).decode("utf-8", "replace") for t in config["model"]["vocab"]}
    vocab_texts = [s for s in spelled.values() if not any(x in s for x in specials)]
    rng, words = random.Random(0), list(spelled.values())
    randoms = [
        " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        if i % 2
        else "".join(rng.choice(MIXED) for _ in range(rng.randint(1, 80)))
        for i in range(args.random_texts)
    ]
    randoms = [s for s in randoms if not any(x in s for x in specials)]
    for name, sample in (("vocabulary strings", vocab_texts), ("random texts", randoms)):
        differ = [s for s in sample if tok.encode(s, add_special_tokens=False).ids != enc.encode_ordinary(s)]
        print(f"{name} without added tokens: {len(differ)} of {len(sample)} differ {differ[:3]}")


if __name__ == "__main__":
    main()
