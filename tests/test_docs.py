"""The guide documents every config field and every hook."""

from dataclasses import fields
from pathlib import Path

from helpers import run_python_forked

from dream_trainer import DreamTrainerConfig
from dream_trainer.callbacks import HOOKS

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()


def test_every_config_field_is_in_the_guide_table():
    missing = [f.name for f in fields(DreamTrainerConfig) if f"| `{f.name}` |" not in GUIDE]
    assert missing == []


def test_every_hook_is_in_the_guide():
    assert [h for h in HOOKS if h not in GUIDE] == []


def test_config_table_is_generated_from_the_code():

    tool = Path(__file__).resolve().parents[1] / "docs" / "tools" / "config_table.py"
    stale = run_python_forked(tool, "--check", timeout=120).returncode
    assert stale == 0, "docs/guide.md's config table is stale: run python docs/tools/config_table.py"
