"""`python -m dlstore` runs the CLI, as the `dlstore` command does."""

import sys

from dlstore.cli import main

sys.exit(main())
