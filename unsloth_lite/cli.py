"""The console commands: argv parsing, and bad input reported in one line with exit code 2.

    unsloth-lite-train --recipe PATH [section.key=value ...] [--merge] [--debug]     (also scripts/train.py)

The work itself is callable from Python: `unsloth_lite.training.run.run_recipe`. Bad input (a recipe key or
value, a data file, line or record, a checkpoint, a LoRA target, an argument) is reported in one line naming
it, with exit code 2 and no traceback (`--debug` re-raises instead).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from unsloth_lite.errors import InputError
from unsloth_lite.recipes import load_recipe

EXIT_USAGE = 2

# bitsandbytes logs an advisory at import on CPUs with AVX-512 BF16 when the optional `kernels` package (which
# fetches kernels from a hub) is absent; its own fallback is used and nothing is wrong, so keep it quiet.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


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
        from unsloth_lite.training.run import run_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        run_recipe(recipe, merge=args.merge, log=lambda message: print(f"{prog}: {message}", flush=True))
        return 0

    return report_input_errors(prog, args.debug, train)


if __name__ == "__main__":
    sys.exit(main())
