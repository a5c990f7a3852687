"""Fine-tune a Qwen model from a recipe: `python scripts/train.py --recipe recipes/tiny_qwen.yaml [key=value ...]`.

The same program is installed as the `unsloth-lite-train` command; see `unsloth_lite/cli.py`.
"""

import sys

from unsloth_lite.cli import main

if __name__ == "__main__":
    sys.exit(main())
