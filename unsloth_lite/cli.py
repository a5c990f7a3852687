"""The console commands: argv parsing, and bad input reported in one line with exit code 2.

    unsloth-lite-train --recipe PATH [section.key=value ...] [--merge] [--debug]     (also scripts/train.py)
    unsloth-lite-generate --model PATH [--adapter RUN_DIR] (--prompt TEXT | --chat) [--max-new-tokens N]
                                                                                     (also scripts/generate.py)

The work itself is callable from Python: `unsloth_lite.training.run.run_recipe`, and
`unsloth_lite.training.generation`'s `load_for_generation`, `generate` and `chat`. Bad input (a recipe key or
value, a data file, line or record, a checkpoint, a LoRA target, an adapter, an argument) is reported in one
line naming it, with exit code 2 and no traceback (`--debug` re-raises instead).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable

from unsloth_lite.errors import InputError
from unsloth_lite.recipes import load_recipe

EXIT_USAGE = 2

# On CPUs with AVX-512 BF16, bitsandbytes' import asks the `kernels` package (a dependency of transformers) for
# a CPU kernel from the Hugging Face Hub. When that fails (no network, offline mode, `kernels` absent) it logs an
# advisory, and `kernels` itself logs one in offline mode; bitsandbytes then uses its own fallback and nothing is
# wrong, so keep both quiet: an input error stays one line.
for _advisory_logger in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_advisory_logger).setLevel(logging.ERROR)


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument error is one line, `PROG: error: MESSAGE`, with exit code 2, as input errors are (argparse's
    own adds the usage, on lines of its own)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help for usage)\n")


def report_input_errors(prog: str, debug: bool, work: Callable[[], int]) -> int:
    """`work()`'s exit code; an `InputError` is printed as one line on stderr with exit code 2, or re-raised
    with `debug`."""
    try:
        return work()
    except InputError as error:
        if debug:
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """`unsloth-lite-train`: fine-tune from a recipe."""
    prog = "unsloth-lite-train"
    parser = OneLineArgumentParser(prog=prog, description="Fine-tune a Qwen model from a recipe.")
    parser.add_argument("--recipe", required=True, help="a recipe file, or the name of a packaged recipe")
    parser.add_argument("--merge", action="store_true", help="also write a merged 16-bit model to OUTPUT_DIR/merged")
    parser.add_argument("--debug", action="store_true", help="on bad input, raise with a traceback instead of one line")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides")
    args = parser.parse_args(argv)

    def train() -> int:
        from unsloth_lite.training.distributed import finish
        from unsloth_lite.training.run import run_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        run_recipe(recipe, merge=args.merge, log=lambda message: print(f"{prog}: {message}", flush=True))
        finish()
        return 0

    return report_input_errors(prog, args.debug, train)


def _number(kind, low: float, high: float = math.inf, low_open: bool = False):
    """An argparse type: a `kind` number in [low, high] (low excluded with `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (low < value if low_open else low <= value) or value > high:
            bounds = f"> {low}" if low_open else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}" + (f" and <= {high}" if high < math.inf else "")
                                             + f", got {text}")
        return value

    return parse


def generate_main(argv: list[str] | None = None) -> int:
    """`unsloth-lite-generate`: text from a base with an optional trained adapter, streamed as it comes, with
    the decoding rate and time to first token at the end (on stderr)."""
    prog = "unsloth-lite-generate"
    parser = OneLineArgumentParser(
        prog=prog, description="Generate text with a Qwen model and, optionally, a LoRA adapter trained by "
        "unsloth-lite-train (unmerged).")
    parser.add_argument("--model", required=True, help="the base: a checkpoint directory or a hub name")
    parser.add_argument("--adapter", help="a training run's output_dir, or a PEFT adapter directory")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="generate a continuation of this text")
    what.add_argument("--chat", action="store_true",
                      help="a conversation in the tokenizer's chat template, one user message per line of stdin")
    parser.add_argument("--max-new-tokens", type=_number(int, 1), default=256, help="per answer (default 256)")
    parser.add_argument("--temperature", type=_number(float, 0.0), default=0.0,
                        help="sample at this temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True), default=1.0,
                        help="nucleus sampling's probability mass, with --temperature (default 1)")
    parser.add_argument("--no-4bit", dest="load_in_4bit", action="store_false",
                        help="keep the base's linear layers in --dtype instead of NF4")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="compute dtype (default bfloat16)")
    parser.add_argument("--debug", action="store_true", help="on bad input, raise with a traceback instead of one line")
    args = parser.parse_args(argv)

    def run() -> int:
        import torch

        from unsloth_lite.training import generation

        model, tokenizer = generation.load_for_generation(
            args.model, args.adapter, load_in_4bit=args.load_in_4bit, dtype=getattr(torch, args.dtype))
        settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)

        def stats(line: str) -> None:
            print(f"{prog}: {line}", file=sys.stderr, flush=True)

        if args.chat:
            generation.chat(model, tokenizer, sys.stdin, on_stats=stats, **settings)
        else:
            prompt = tokenizer(args.prompt)["input_ids"]
            stats(generation.generate(model, tokenizer, prompt, on_text=generation.print_text, **settings).stats())
        return 0

    return report_input_errors(prog, args.debug, run)


if __name__ == "__main__":
    sys.exit(main())
