"""`python -m lmforge ...`, which is also how torchrun starts it: `torchrun ... -m lmforge train @ run.toml`."""

import sys

from lmforge.cli import main

if __name__ == "__main__":
    sys.exit(main())
