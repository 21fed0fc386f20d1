"""``python -m scrubber prolog|epilog``: what slurmd runs (through the rendered wrappers)."""

import sys

from scrubber.cli import main

sys.exit(main())
