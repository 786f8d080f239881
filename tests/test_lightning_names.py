"""`MODULE_NAMES` and `CALLBACK_NAMES` (dream_trainer/lightning/names.py): every name of the installed
Lightning's `LightningModule` and `Callback` is a key, every target exists here, and the migration
guide's tables are generated from them."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import run_python_forked

from dream_trainer import Callback, DataModule, DreamTrainer, DreamTrainerConfig, callbacks
from dream_trainer.callbacks.base import HOOKS
from dream_trainer.lightning.names import CALLBACK_NAMES, MODULE_NAMES, Ours

ROOT = Path(__file__).resolve().parents[1]


def lightning_defined(cls: type) -> set[str]:
    """The public names Lightning itself defines on `cls`: what a user of `cls` writes or calls.

    The rule, read from the classes with `inspect.getmro` and `vars` (not `dir`, which lists inherited
    names without saying who defined them):

    - the classes are those of `cls`'s MRO before `torch.nn.Module` (or `object`): for `LightningModule`
      that is `LightningModule` and its bases `_DeviceDtypeModuleMixin`, `HyperparametersMixin`,
      `ModelHooks`, `DataHooks` and `CheckpointHooks`; for `Callback`, `Callback`;
    - a name counts when one of those classes defines it (`vars(klass)`), whatever it is (a method, a
      property, a classmethod, a constant such as `CHECKPOINT_HYPER_PARAMS_KEY`);
    - names starting with `_` are private and do not count;
    - for a `torch.nn.Module` subclass, names `torch.nn.Module` also has do not count: Lightning redefines
      `to`, `cuda`, `cpu`, `type`, `float`, `double` and `half` only to track its device and dtype, and
      `forward` only to document it; they are `nn.Module`'s API, which the models assigned to a trainer
      keep. (`forward` is in the table all the same, because a `LightningModule` writes it: an extra key,
      which the tests allow.) A `Callback` is no module: its `state_dict` and `load_state_dict` count.
    """
    mro = inspect.getmro(cls)
    is_module = torch.nn.Module in mro
    own = mro[: mro.index(torch.nn.Module if is_module else object)]
    names = {name for klass in own for name in vars(klass) if not name.startswith("_")}
    return names - set(dir(torch.nn.Module)) if is_module else names


# --- (a) complete against the installed Lightning ---------------------------------------------------------
def test_every_lightning_module_name_is_in_the_table():
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule

    missing = sorted(lightning_defined(LightningModule) - set(MODULE_NAMES))
    assert missing == [], (
        f"Lightning {lightning.__version__}'s LightningModule defines {missing}, which MODULE_NAMES in "
        "dream_trainer/lightning/names.py lacks: add each (where it is here, or None and what to write "
        "instead), then run python docs/tools/lightning_tables.py"
    )
    # And nothing else: every key is a name a LightningModule has (a typo would list a name nobody has).
    assert sorted(set(MODULE_NAMES) - set(dir(LightningModule))) == []


def test_every_lightning_callback_hook_is_in_the_table():
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch import Callback as LightningCallback

    expected = lightning_defined(LightningCallback)
    missing = sorted(expected - set(CALLBACK_NAMES))
    assert missing == [], (
        f"Lightning {lightning.__version__}'s Callback defines {missing}, which CALLBACK_NAMES in "
        "dream_trainer/lightning/names.py lacks: add each, then run python docs/tools/lightning_tables.py"
    )
    assert sorted(set(CALLBACK_NAMES) - expected) == []


def test_the_rule_sees_what_a_migrating_user_writes():
    # The rule above, on the installed Lightning: hooks of each hook base class, methods, properties.
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule

    found = lightning_defined(LightningModule)
    for name in ("on_train_batch_end", "train_dataloader", "on_save_checkpoint", "log", "save_hyperparameters"):
        assert name in found
    for name in ("device", "hparams", "global_step", "automatic_optimization", "trainer"):
        assert name in found
    assert not found & {"to", "cuda", "parameters", "state_dict", "forward", "_log_hyperparams"}


# --- (b) every target exists ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_attributes(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What every `DreamTrainer` has: its class's attributes and those `__init__` sets (nothing is
    written anywhere: building a trainer creates no file)."""
    root = tmp_path_factory.mktemp("lightning_names")
    trainer = DreamTrainer(DreamTrainerConfig(device="cpu", loggers=[], root_dir=str(root)))
    assert list(root.iterdir()) == []
    return {n for n in (*dir(DreamTrainer), *vars(trainer)) if not n.startswith("_")}


def target_exists(target: str, bare: set[str]) -> bool:
    """`target` in the syntax `Ours` documents: `name` (one of `bare`), `config.name`, `callbacks.Name`
    or `DataModule.name`."""
    kind, _, name = target.rpartition(".")
    if name.startswith("_"):
        return False
    if kind == "":
        return name in bare
    if kind == "config":
        return name in {f.name for f in fields(DreamTrainerConfig)}
    if kind == "callbacks":
        return name in callbacks.__all__ and inspect.isclass(getattr(callbacks, name))
    if kind == "DataModule":
        return callable(getattr(DataModule, name, None))
    return False


def test_target_syntax_is_checked():
    bare = {"log"}
    assert target_exists("log", bare) and not target_exists("logg", bare)
    assert target_exists("config.n_epochs", bare) and not target_exists("config.max_epochs", bare)
    assert target_exists("callbacks.EarlyStopping", bare) and not target_exists("callbacks.Early", bare)
    assert target_exists("DataModule.prepare_data", bare) and not target_exists("DataModule.hparams_x", bare)
    assert not target_exists("Trainer.fit", bare) and not target_exists("_private", {"_private"})


def test_every_module_target_exists(trainer_attributes):
    missing = {k: o.target for k, o in MODULE_NAMES.items() if o.target is not None}
    missing = {k: t for k, t in missing.items() if not target_exists(t, trainer_attributes)}
    assert missing == {}


def test_every_callback_target_is_a_dream_trainer_callback_hook():
    bare = {n for n in dir(Callback) if not n.startswith("_")}
    missing = {k: o.target for k, o in CALLBACK_NAMES.items() if o.target is None or not target_exists(o.target, bare)}
    assert missing == {}
    # Every hook of ours is one of Lightning's (callbacks keep Lightning's vocabulary, nothing extra).
    assert set(HOOKS) <= {o.target for o in CALLBACK_NAMES.values()}


def test_hooks_map_to_the_hook_of_the_same_name():
    # A Lightning hook we have keeps its name: the tables never send one to a differently named hook.
    for table in (MODULE_NAMES, CALLBACK_NAMES):
        for name, ours in table.items():
            if ours.target in HOOKS or name in HOOKS:
                assert ours.target in (name, None), (name, ours)


@pytest.mark.parametrize("table", [MODULE_NAMES, CALLBACK_NAMES], ids=["module", "callback"])
def test_every_note_is_one_table_cell(table: dict[str, Ours]):
    for name, ours in table.items():
        assert ours.note and "\n" not in ours.note and "|" not in ours.note, name
        assert ours.note.count("`") % 2 == 0, f"{name}: unbalanced backticks in {ours.note!r}"
        if ours.target is None:  # not supported: the note must say what to write, not claim sameness
            assert not ours.note.startswith("the same"), name


# --- (c) the guide is generated from the tables ----------------------------------------------------------
def test_migration_tables_are_generated_from_the_code():
    tool = ROOT / "docs" / "tools" / "lightning_tables.py"
    stale = run_python_forked(tool, "--check", timeout=120).returncode
    assert stale == 0, (
        "docs/migrating-from-lightning.md's LightningModule/Callback tables are stale: "
        "run python docs/tools/lightning_tables.py"
    )


def test_every_name_has_its_row_in_the_guide():
    doc = (ROOT / "docs" / "migrating-from-lightning.md").read_text()
    for name in (*MODULE_NAMES, *CALLBACK_NAMES):
        assert f"| `{name}` | " in doc, name
