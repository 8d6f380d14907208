"""Write bench/assets/tokenizer.json: SmolLM2's tokenizer rebuilt from its GGUF, for the random-
weight W1-W3 models (their vocabulary, 151936, holds all its ids). The H200 has no GGUF reader and
the model package is too large to carry, so make it here and carry bench/assets (git-ignored).

    python -m bench.assets
"""

from pathlib import Path

from handlers.demo import smollm2
from slm_core.compile.checkpoint import load_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"

if __name__ == "__main__":
    ASSETS.mkdir(exist_ok=True)
    load_checkpoint(smollm2()).tokenizer.save(str(ASSETS / "tokenizer.json"))
    print(ASSETS / "tokenizer.json")
