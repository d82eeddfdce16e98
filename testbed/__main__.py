"""``python -m testbed ACTION``: the same as ``specpilot testbed ACTION``."""

import sys

from controller.cli import main

sys.exit(main(["testbed", *sys.argv[1:]]))
