"""`python -m dream_trainer.cli ...` is the `dream-trainer` command."""

import sys

from dream_trainer.cli.main import main

sys.exit(main())
