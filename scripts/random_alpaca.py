"""Alpaca-format records of random words of `bench_train_setup.py`'s stand-in tokenizer (t0 .. t{V-4}, one token
each), for throughput runs of the recipes on its random-weight checkpoints:

    python scripts/random_alpaca.py /tmp/alpaca.jsonl --vocab 151936 --records 256 --words 2400
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def write_records(path: str, vocab: int, records: int, words: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(f"t{rng.randrange(vocab - 3)}" for _ in range(n))  # the last 3 ids are special tokens

    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps({"instruction": text(words // 2), "input": "", "output": text(words - words // 2)}))
            f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size of the checkpoint")
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--words", type=int, default=2400, help="words per record (instruction + output)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_records(args.path, args.vocab, args.records, args.words, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
