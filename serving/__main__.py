"""``python -m serving [MODEL] [flags]``: see ``serving.cli``."""

import sys

from serving.cli import main

sys.exit(main(prog="python -m serving"))
