"""`python -m dlstore` runs the CLI (the same as the `dlstore` command)."""

import sys

from dlstore.cli import main

sys.exit(main())
