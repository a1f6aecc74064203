"""``python -m serving [MODEL] [flags]``: see ``serving.cli``."""

import sys

from serving.cli import serve_main

sys.exit(serve_main(prog="python -m serving"))
