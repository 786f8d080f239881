"""The `dream-trainer` command: fit/validate/test from YAML and flags, --help, resume, clean errors.

In-process through `main(argv)` / `run(argv)`; `python -m dream_trainer.cli` as its own process where the exit
status and what reaches stderr are the point (forked with torch already imported: `helpers.run_python_forked`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_python_forked
from torch import nn

from dream_trainer.callbacks import EarlyStopping, LearningRateMonitor
from dream_trainer.cli import load_trainer_class, main, run
from dream_trainer.loggers import CSVLogger

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cli_trainer.py"
YAML = ROOT / "examples" / "configs" / "regression.yaml"
TARGET = f"{EXAMPLE}:RegressionTrainer"


def small(root: Path) -> list[str]:
    """Flags for a quick run: 4 batches per epoch, nothing printed, outputs under `root`."""
    return [
        "--n_train", "64", "--n_val", "32", "--batch_size", "16", "--root_dir", str(root),
        "--enable_progress_bar", "false", "--print_epoch_summary", "false",
    ]  # fmt: skip


def test_fit_from_yaml_with_flag_overrides(tmp_path: Path) -> None:
    result = run(["fit", TARGET, "--config", str(YAML), "--n_epochs", "2", *small(tmp_path)])
    trainer = result.trainer
    assert result.command == "fit" and result.metrics is None
    assert trainer.config.n_epochs == 2  # the flag beats the YAML's 5
    assert trainer.config.n_train == 64 and trainer.config.log_every_n_steps == 10  # flag / YAML
    assert trainer.global_step == 2 * 64 // 16
    # The YAML's model / optimizer / scheduler configs, built by the trainer through the registries.
    assert len(trainer.model.net) == 5  # depth 2: (Linear, ReLU) x 2 + Linear
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 1e-4
    assert isinstance(trainer.scheduler, torch.optim.lr_scheduler.StepLR)
    # callbacks / loggers entries built through CALLBACKS / LOGGERS.
    assert any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks)
    assert [cb.patience for cb in trainer.callbacks if isinstance(cb, EarlyStopping)] == [3]
    assert [type(lg) for lg in trainer.config.loggers] == [CSVLogger]
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "version_0" / "metrics.csv").exists()


def test_trainer_named_in_yaml_and_exit_code(tmp_path: Path) -> None:
    # regression.yaml says `trainer: ../cli_trainer.py:RegressionTrainer`, relative to the YAML file.
    assert main(["fit", "--config", str(YAML), "--n_epochs", "1", *small(tmp_path)]) == 0
    assert (tmp_path / "version_0" / "checkpoints" / "last.ckpt").exists()


def test_print_config_shows_resolved_values_in_order(tmp_path: Path, capsys) -> None:
    argv = ["fit", TARGET, "--n_epochs", "3", "--config", str(YAML), "--batch_size", "8", "--print_config"]
    assert main(argv) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["n_epochs"] == 5  # the YAML came after --n_epochs 3: later sources win
    assert cfg["batch_size"] == 8
    assert cfg["trainer"] == TARGET
    assert cfg["optimizer"] == {"type": "AdamW", "lr": 0.01, "weight_decay": 0.0001}
    assert cfg["callbacks"][1] == {"type": "EarlyStopping", "monitor": "val_loss", "patience": 3}
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_nested_dict_flag(capsys) -> None:
    assert main(["fit", TARGET, "--config", str(YAML), "--optimizer.lr", "0.05", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optimizer"]["lr"] == 0.05


# Quick flags whose outputs stay relative: the YAML's `root_dir: runs/regression` is relative to the directory.
QUICK = [
    "--n_epochs", "1", "--n_train", "64", "--n_val", "32", "--batch_size", "16",
    "--enable_progress_bar", "false", "--print_epoch_summary", "false",
]  # fmt: skip


@pytest.mark.parametrize("named", ["as the argument", "by the yaml"])
def test_printed_config_runs_back_from_another_directory(tmp_path: Path, named: str) -> None:
    # The example project, printed from its own directory with relative paths (the trainer relative to the
    # working directory, or to the YAML file that names it), then run from elsewhere as it was printed.
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "configs").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(EXAMPLE, project / "cli_trainer.py")
    shutil.copy(YAML, project / "configs" / "regression.yaml")  # trainer: ../cli_trainer.py:RegressionTrainer
    trainer = ["cli_trainer.py:RegressionTrainer"] if named == "as the argument" else []
    printed = _cli(["fit", *trainer, "--config", "configs/regression.yaml", *QUICK, "--print_config"], project)
    assert printed.returncode == 0, printed.stderr
    (elsewhere / "run.yaml").write_text(printed.stdout)

    proc = _cli(["fit", "--config", "run.yaml"], elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert (project / "runs" / "regression" / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["run.yaml"]  # it wrote where the printed run would
    cfg = yaml.safe_load(printed.stdout)
    assert cfg["trainer"] == f"{(project / 'cli_trainer.py').resolve()}:RegressionTrainer"
    assert cfg["root_dir"] == str((project / "runs" / "regression").resolve())


def test_print_config_makes_relative_paths_absolute(tmp_path: Path, monkeypatch, capsys, plain_lin: str) -> None:
    work, lib = tmp_path / "work", tmp_path / "lib"
    work.mkdir()
    lib.mkdir()
    source = Path(plain_lin).read_text()
    (work / "cwd_lin_mod.py").write_text(source)  # imports only from this directory (`python -m` puts it on sys.path)
    (lib / "lib_lin_mod.py").write_text(source)  # imports from anywhere
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.syspath_prepend(str(lib))
    here = Path.cwd()
    loggers = "[{type: CSVLogger, save_dir: logs}, {type: CSVLogger}, {type: CSVLogger, save_dir: /abs/logs}, "
    loggers += "{class_path: dream_trainer.loggers.JSONLinesLogger, init_args: {save_dir: jsonl}}]"
    flags = [
        "--model", "{type: torch.nn.Linear, in_features: 4, out_features: 1}", "--root_dir", "runs",
        "--resume_from", "old/last.ckpt", "--ckpt_path", "last", "--loggers", loggers, "--print_config",
    ]  # fmt: skip
    assert main(["fit", "cwd_lin_mod:LinTrainer", *flags]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"] == f"{here / 'cwd_lin_mod.py'}:LinTrainer"  # the module by its file
    assert cfg["root_dir"] == str(here / "runs")
    assert cfg["resume_from"] == str(here / "old" / "last.ckpt")
    assert cfg["ckpt_path"] == "last"  # a keyword, not a path
    assert cfg["loggers"] == [
        {"type": "CSVLogger", "save_dir": str(here / "logs")},  # annotated `str | os.PathLike[str] | None`
        {"type": "CSVLogger"},
        {"type": "CSVLogger", "save_dir": "/abs/logs"},
        {"class_path": "dream_trainer.loggers.JSONLinesLogger", "init_args": {"save_dir": str(here / "jsonl")}},
    ]
    assert cfg["model"] == {"type": "torch.nn.Linear", "in_features": 4, "out_features": 1}
    assert main(["fit", "lib_lin_mod:LinTrainer", *flags]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"] == "lib_lin_mod:LinTrainer"  # importable: as given


def test_help_lists_config_fields_with_docstrings(capsys) -> None:
    assert main(["fit", TARGET, "--help"]) == 0
    out = capsys.readouterr().out
    for text in (
        "--n_epochs",
        "Epochs to train.",  # DreamTrainerConfig's attribute docstrings
        "--gradient_accumulation_steps",
        "--batch_size",
        "Samples per batch.",  # RegressionConfig's own field
        "--callbacks",
        "EarlyStopping",
        "--model",
        "--optimizer",
        "--ckpt_path",
        "--print_config",
    ):
        assert text in out, text


def test_help_without_trainer(capsys) -> None:
    assert main(["fit", "--help"]) == 0
    assert "TRAINER is path/to/file.py:ClassName" in " ".join(capsys.readouterr().out.split())
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "fit" in out and "validate" in out


def test_validate_prints_and_returns_metrics(tmp_path: Path, capsys) -> None:
    assert main(["fit", TARGET, "--config", str(YAML), "--n_epochs", "1", *small(tmp_path)]) == 0
    capsys.readouterr()
    argv = ["validate", TARGET, "--config", str(YAML), "--ckpt_path", "last", *small(tmp_path)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)  # stdout holds the JSON line only
    assert set(printed) == {"val_loss"} and printed["val_loss"] > 0
    # stderr says which checkpoint "last" was (issue 36: it was never printed).
    last = (tmp_path / "version_0" / "checkpoints" / "last.ckpt").resolve()
    assert f"dream-trainer validate: evaluated checkpoint {last}" in err.splitlines(), err
    result = run(argv)
    assert result.metrics is not None and result.metrics["val_loss"] == pytest.approx(printed["val_loss"])
    assert result.trainer.global_step == 4  # the checkpoint's weights and counters


def test_resume_with_ckpt_path_last_continues(tmp_path: Path, monkeypatch) -> None:
    first = run(["fit", TARGET, "--config", str(YAML), "--n_epochs", "1", *small(tmp_path)])
    assert first.trainer.global_step == 4
    cls = load_trainer_class(TARGET)
    calls = []
    original = cls.training_step

    def counting(self, batch, batch_idx):
        calls.append(batch_idx)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(cls, "training_step", counting)
    second = run(["fit", TARGET, "--config", str(YAML), "--n_epochs", "2", "--ckpt_path", "last", *small(tmp_path)])
    assert second.trainer.global_step == 8 and second.trainer.current_epoch == 2
    assert calls == [0, 1, 2, 3]  # only the second epoch ran


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--n_epochs", "0"], "RegressionConfig.n_epochs = 0 is invalid: expected a positive integer"),
        (["--device", "tpu"], "RegressionConfig.device = 'tpu' is invalid: valid choices are"),
        (["--mixed_precision", "fp8"], "RegressionConfig.mixed_precision = 'fp8' is invalid"),
        (["--n_epochs", "abc"], "n_epochs = 'abc' is invalid: expected int or null"),
        (["--n_epoch", "2"], "unrecognized arguments: --n_epoch 2 (did you mean --n_epochs?)"),
        (["--callbacks", "[EarlyStoping]"], "callbacks[0]: 'EarlyStoping' is not registered in callbacks. Did you"),
        (["--loggers", "[{type: CSVLogger, nope: 1}]"], "loggers[0]: cannot build CSVLogger"),
    ],
)
def test_bad_values_exit_2_naming_the_field(tmp_path: Path, capsys, flags: list[str], expected: str) -> None:
    assert main(["fit", TARGET, "--config", str(YAML), "--root_dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert expected.lower() in err.lower(), err  # jsonargparse capitalizes "Unrecognized" in some versions
    assert "Traceback" not in err
    assert not any(tmp_path.glob("version_*"))  # no run was started


def test_bad_key_in_yaml_exit_2(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("n_epoch: 3\n")
    assert main(["fit", TARGET, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml, line 1: unknown key 'n_epoch' (did you mean n_epochs?)" in err


def test_unknown_trainer_lists_subclasses_found(capsys) -> None:
    assert main(["fit", f"{EXAMPLE}:RegresionTrainer"]) == 2
    err = capsys.readouterr().err
    assert "has no class 'RegresionTrainer'. Did you mean 'RegressionTrainer'?" in err
    assert "DreamTrainer subclasses found there: RegressionTrainer" in err
    assert main(["fit", f"{EXAMPLE}:MLP"]) == 2
    assert "not a DreamTrainer subclass" in capsys.readouterr().err
    assert main(["fit", "no/such/file.py:T"]) == 2
    assert "trainer file 'no/such/file.py' not found" in capsys.readouterr().err
    assert main(["fit"]) == 2
    assert "which trainer?" in capsys.readouterr().err
    assert main(["fitt"]) == 2
    assert "invalid choice" in capsys.readouterr().err


TRAINER_FILE = '''
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.registry import MODELS


@MODELS.register("TinyLinear")
class Tiny(nn.Linear):
    def __init__(self):
        super().__init__(4, 1)


@dataclass
class LinConfig(DreamTrainerConfig):
    n: int = 32
    """Samples."""


class LinTrainer(DreamTrainer):
    config_class = LinConfig

    def __init__(self, config, model: nn.Module, lr: float = 0.1, tags: list[str] | None = None):
        super().__init__(config)
        self.model = model
        self.lr = lr
        self.tags = tags

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def _data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.config.n, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def configure_dataloaders(self):
        return self._data(), None

    def configure_test_dataloader(self):
        return self._data()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}
'''


@pytest.fixture
def lin_trainer(tmp_path: Path) -> Path:
    path = tmp_path / "lin_trainer.py"
    path.write_text(textwrap.dedent(TRAINER_FILE))
    return path


def test_init_arguments_built_through_registry(tmp_path: Path, lin_trainer: Path, capsys) -> None:
    cfg = tmp_path / "lin.yaml"
    cfg.write_text(
        "n_epochs: 1\nloggers: []\nenable_progress_bar: false\nprint_epoch_summary: false\n"
        "model: {type: torch.nn.Linear, in_features: 4, out_features: 1}\n"
    )
    # `file.py` alone: it defines one trainer. `config_class` names the config (n is a flag).
    result = run(["fit", str(lin_trainer), "--config", str(cfg), "--lr", "0.2", "--n", "16", "--tags", "[a, b]"])
    trainer = result.trainer
    assert isinstance(trainer.model, nn.Linear) and trainer.lr == 0.2 and trainer.tags == ["a", "b"]
    assert trainer.config.n == 16 and trainer.global_step == 2

    # A class-typed parameter also takes a bare name; test runs the test loop.
    result = run(["test", str(lin_trainer), "--model", "TinyLinear", "--n", "8", "--loggers", "[]"])
    assert type(result.trainer.model).__name__ == "Tiny" and result.trainer.lr == 0.1
    assert result.metrics is not None and "test_loss" in result.metrics

    capsys.readouterr()
    assert main(["fit", str(lin_trainer), "--n", "8"]) == 2  # `model` has no default
    assert "model" in capsys.readouterr().err
    assert main(["fit", str(lin_trainer), "--model", "{type: Linearr}"]) == 2
    assert "model: 'Linearr' is not registered in any registry" in capsys.readouterr().err


def test_python_m_dream_trainer_cli_help() -> None:
    proc = run_python_forked("-m", "dream_trainer.cli", "fit", TARGET, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--n_epochs" in proc.stdout and "Epochs to train." in proc.stdout


# --- errors: one line on stderr, exit 2 (usage, config) or 1 (the run cannot go on), no traceback -------
def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _trainer_file(directory: Path, name: str, prefix: str = "", suffix: str = "") -> str:
    return _write(directory / name, prefix + textwrap.dedent(TRAINER_FILE) + suffix)


def _lin(directory: Path, *flags: str) -> list[str]:
    """`LinTrainer` (a `test_step`, no `validation_step`) with the arguments a quick run needs."""
    return [_trainer_file(directory, "lin_trainer.py"), "--model", "TinyLinear", "--loggers", "[]", *flags]


def _regression(directory: Path, *flags: str) -> list[str]:
    """`RegressionTrainer` (a `validation_step`, no `test_step`) from the example YAML, quick, under `directory`."""
    return [TARGET, "--config", str(YAML), *small(directory / "runs"), *flags]


# name -> (arguments under a fresh directory, exit status, a piece of the one line)
ERROR_CASES: dict[str, Callable[[Path], tuple[list[str], int, str]]] = {
    "unknown flag": lambda d: (["fit", *_regression(d, "--n_epoch", "2")], 2, "(did you mean --n_epochs?)"),
    "yaml syntax": lambda d: (
        ["fit", TARGET, "--config", _write(d / "bad.yaml", "n_epochs: [1\n")],
        2,
        "bad.yaml: invalid YAML at line 2, column 1",
    ),
    "yaml not a mapping": lambda d: (
        ["fit", TARGET, "--config", _write(d / "list.yaml", "- 1\n- 2\n")],
        2,
        "expected `field: value` lines at the top level, found a list",
    ),
    "config file missing": lambda d: (["fit", TARGET, "--config", str(d / "none.yaml")], 2, "none.yaml: no such file"),
    "unknown config key": lambda d: (
        ["fit", TARGET, "--config", _write(d / "key.yaml", "n_epoch: 3\n")],
        2,
        "key.yaml, line 1: unknown key 'n_epoch' (did you mean n_epochs?)",
    ),
    "bad value": lambda d: (["fit", *_regression(d, "--n_epochs", "0")], 2, "n_epochs = 0 is invalid"),
    "bad type": lambda d: (
        ["fit", *_regression(d, "--n_epochs", "abc")],
        2,
        "n_epochs = 'abc' is invalid: expected int or null",
    ),
    "trainer syntax error": lambda d: (
        ["fit", _trainer_file(d, "broken.py", suffix="\ndef broken(:\n")],
        2,
        "SyntaxError: invalid syntax (broken.py, line",
    ),
    "trainer import error": lambda d: (
        ["fit", _trainer_file(d, "needs_dep.py", prefix="import no_such_module_xyz\n")],
        2,
        "No module named 'no_such_module_xyz' (needs_dep.py, line 1); install it",
    ),
    "trainer module missing": lambda d: (
        ["fit", "no_such_package_xyz.module:Trainer"],
        2,
        "cannot import module 'no_such_package_xyz.module'",
    ),
    "test without test_step": lambda d: (
        ["test", *_regression(d, "--ckpt_path", "last")],
        1,
        "RegressionTrainer has no test_step, which `test` runs: define `def test_step(self, batch, batch_idx):`",
    ),
    "validate without validation_step": lambda d: (
        ["validate", *_lin(d)],
        1,
        "LinTrainer has no validation_step, which `validate` runs",
    ),
    "checkpoint missing": lambda d: (
        ["validate", *_regression(d, "--ckpt_path", str(d / "nope.ckpt"))],
        1,
        "nope.ckpt: no such file or directory",
    ),
    "checkpoint unreadable": lambda d: (
        ["validate", *_regression(d, "--ckpt_path", _write(d / "torn.ckpt", "not a checkpoint\n"))],
        1,
        "torn.ckpt",
    ),
    "last with nothing to resume": lambda d: (
        ["validate", *_regression(d, "--ckpt_path", "last")],
        1,
        "--ckpt_path last: no checkpoint in any run under ",
    ),
}


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m dream_trainer.cli ARGV`: the real command, in its own process (forked with torch imported)."""
    return run_python_forked("-m", "dream_trainer.cli", *argv, timeout=300, cwd=cwd)


def _error_lines(stderr: str) -> list[str]:
    """stderr without the line a started run prints about its directory."""
    return [
        line for line in stderr.splitlines() if line.strip() and not line.startswith("dream_trainer: run directory")
    ]


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_are_one_line_with_an_exit_status(tmp_path: Path, case: str) -> None:
    argv, status, text = ERROR_CASES[case](tmp_path)
    proc = _cli(argv, tmp_path)
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dream-trainer {argv[0]}: error: "), lines[0]
    assert text in lines[0], lines[0]
    if case != "checkpoint unreadable":  # found before a run started: nothing left behind
        assert "run directory" not in proc.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["trainer syntax error", "test without test_step"])
def test_debug_flag_shows_the_traceback(tmp_path: Path, case: str) -> None:
    argv, status, text = ERROR_CASES[case](tmp_path)
    proc = _cli(["--debug", *argv], tmp_path)
    assert proc.returncode == status, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert text in proc.stderr.strip().splitlines()[-1]  # the one line still ends it


def test_an_exception_in_the_trainers_own_code_keeps_its_traceback(tmp_path: Path) -> None:
    body = "x, y = batch\n        return F.mse_loss(self.model(x), y)\n\n    def test_step"
    source = textwrap.dedent(TRAINER_FILE).replace(
        body, 'raise RuntimeError("bug in training_step")\n\n    def test_step'
    )
    assert "bug in training_step" in source
    trainer = _write(tmp_path / "buggy.py", source)
    proc = _cli(["fit", trainer, "--model", "TinyLinear", "--loggers", "[]", "--root_dir", str(tmp_path)], tmp_path)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'buggy.py", line' in proc.stderr and "RuntimeError: bug in training_step" in proc.stderr


def test_debug_after_the_command_says_where_it_goes(capsys) -> None:
    assert main(["fit", TARGET, "--config", str(YAML), "--debug"]) == 2
    assert "--debug goes before the command: dream-trainer --debug fit" in capsys.readouterr().err
    assert main(["--debug", "fitt"]) == 2
    assert "invalid choice of command 'fitt' (did you mean 'fit'?)" in capsys.readouterr().err


# --- configs are data: names resolve to classes; Lightning's names get Python's hints ------------------
MARKER_MODULE = """
from pathlib import Path


def touch(path):
    Path(path).write_text("called")
"""


@pytest.fixture(scope="module")
def plain_lin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """LinTrainer in a file that registers nothing (so it may be imported next to `lin_trainer.py`)."""
    source = textwrap.dedent(TRAINER_FILE).replace('@MODELS.register("TinyLinear")\n', "")
    return _write(tmp_path_factory.mktemp("plain") / "plain_lin_trainer.py", source)


def test_yaml_type_naming_a_function_is_refused_before_it_is_called(
    tmp_path: Path, capsys, monkeypatch, plain_lin: str
) -> None:
    # `type: os.system` would run a shell command; a function that writes a file shows whether it was called.
    (tmp_path / "cli_marker_mod.py").write_text(MARKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "CALLED"
    cfg = _write(tmp_path / "evil.yaml", f"callbacks:\n  - type: cli_marker_mod.touch\n    path: {marker}\n")
    assert main(["fit", TARGET, "--config", cfg, "--root_dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert "callbacks[0]: 'cli_marker_mod.touch' names a function, not a class" in err, err
    assert not (tmp_path / "runs").exists()
    # The same for an `__init__` argument built through the registries, and the class_path form.
    assert main(["fit", plain_lin, "--model", f"{{type: cli_marker_mod.touch, path: {marker}}}"]) == 2
    class_path = f"{{class_path: cli_marker_mod:touch, init_args: {{path: {marker}}}}}"
    assert main(["fit", plain_lin, "--model", class_path]) == 2
    assert not marker.exists()
    assert "names a function, not a class" in capsys.readouterr().err


def test_lightning_flag_gets_the_hint_python_gives(tmp_path: Path, capsys) -> None:
    assert main(["fit", *_regression(tmp_path, "--accumulate_grad_batches", "2")]) == 2
    err = capsys.readouterr().err
    assert "here write --gradient_accumulation_steps (the same meaning)" in err, err
    assert "limit_train_batches" not in err
    assert len(err.strip().splitlines()) == 1
    # Several unknown flags: each named, on a line of its own below the first.
    assert main(["fit", *_regression(tmp_path, "--max_epochs", "2", "--benchmark", "true", "--n_epoch", "1")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("dream-trainer fit: error: unrecognized arguments: --max_epochs 2")
    assert lines[1:] == [
        "  --max_epochs: Lightning's Trainer argument; here write --n_epochs (the same meaning)",
        "  --benchmark: Lightning's Trainer argument; here it is not a config field: "
        "set torch.backends.cudnn.benchmark yourself",
        "  --n_epoch: did you mean --n_epochs?",
    ]
    assert not (tmp_path / "runs").exists()


def test_yaml_reports_every_unknown_key_with_its_line(tmp_path: Path, capsys) -> None:
    cfg = _write(
        tmp_path / "lightning.yaml",
        "n_epochs: 1\nmax_epochs: 3\n# a comment\naccumulate_grad_batches: 2\nbatch_sise: 8\nseed: 1\n",
    )
    assert main(["fit", TARGET, "--config", cfg]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == (
        f"dream-trainer fit: error: --config {cfg}: 3 unknown keys: 'max_epochs' (line 2), "
        "'accumulate_grad_batches' (line 4), 'batch_sise' (line 5); fix or remove each (below)"
    )
    assert lines[1:] == [
        "  line 2: max_epochs: Lightning's Trainer argument; here write n_epochs: (the same meaning)",
        "  line 4: accumulate_grad_batches: Lightning's Trainer argument; here write gradient_accumulation_steps: "
        "(the same meaning)",
        "  line 5: batch_sise: did you mean batch_size?",
    ]
    # One Lightning key: one line, with the hint Python gives.
    one = _write(tmp_path / "one.yaml", "n_epochs: 1\naccumulate_grad_batches: 2\n")
    assert main(["fit", TARGET, "--config", one]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"dream-trainer fit: error: --config {one}, line 2: unknown key 'accumulate_grad_batches' "
        "(accumulate_grad_batches is Lightning's Trainer argument; here write gradient_accumulation_steps: "
        "(the same meaning))"
    )


def test_long_details_are_left_to_debug(tmp_path: Path, capsys, plain_lin: str) -> None:
    # An unknown name in every registry: the first line says what to do; the listing needs --debug.
    argv = ["fit", plain_lin, "--model", "{type: NoSuchNet}", "--root_dir", str(tmp_path)]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 300 + len("dream-trainer fit: error: "), lines
    assert "model: 'NoSuchNet' is not registered in any registry" in lines[0]
    assert "dream-trainer --debug ... shows the details" in lines[0]
    assert main(["--debug", *argv]) == 2
    assert "Registered: models: " in capsys.readouterr().err
