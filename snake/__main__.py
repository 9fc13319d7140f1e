"""`python -m snake`: the `snake` command."""

import sys

from snake.cli import main

sys.exit(main())
