"""Generate text with a base model and, optionally, a trained adapter:
`python scripts/generate.py --model PATH [--adapter RUN_DIR] (--prompt TEXT | --chat) [--max-new-tokens N]`.

The same program is installed as the `unsloth-lite-generate` command; see `unsloth_lite/cli.py`.
"""

import sys

from unsloth_lite.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main())
