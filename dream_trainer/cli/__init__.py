"""The `dream-trainer` command line: `fit`, `validate` and `test` a DreamTrainer from YAML and flags.

`dream-trainer fit path/to/file.py:MyTrainer --config cfg.yaml --n_epochs 3`; see `dream_trainer.cli.main`.
"""

from dream_trainer.cli.loading import CLIError, config_class_of, load_trainer_class
from dream_trainer.cli.main import CLIResult, build_parser, main, run

__all__ = ["CLIError", "CLIResult", "build_parser", "config_class_of", "load_trainer_class", "main", "run"]
