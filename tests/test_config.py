"""DreamTrainerConfig: every bad value fails at construction with a ConfigError that says what to change."""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from conftest import RecordingCallback

from dream_trainer import Callback, ConfigError, DreamTrainerConfig, Logger, MemoryLogger


@dataclass
class MyConfig(DreamTrainerConfig):
    """A user's config with an extra field (seed 004)."""

    learning_rate: float = 1e-3


def _error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        DreamTrainerConfig(**kwargs)
    return str(info.value)


def _assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in error message {message!r}"


POSITIVE_INT = "positive integer"

# (field, bad value, substring describing what is valid)
BAD_VALUES = [
    ("n_epochs", 0, POSITIVE_INT),
    ("n_epochs", -1, POSITIVE_INT),
    ("n_epochs", 2.5, POSITIVE_INT),
    ("n_epochs", True, POSITIVE_INT),
    ("max_steps", 0, POSITIVE_INT),
    ("max_steps", -5, POSITIVE_INT),
    ("max_steps", True, POSITIVE_INT),
    ("limit_train_batches", "all", "float in [0.0, 1.0]"),
    ("limit_train_batches", -1, "int >= 0"),
    ("limit_train_batches", 1.5, "float in [0.0, 1.0]"),
    ("limit_train_batches", -0.1, "float in [0.0, 1.0]"),
    ("limit_train_batches", True, "int >= 0"),
    ("limit_val_batches", "some", "float in [0.0, 1.0]"),
    ("limit_val_batches", -2, "int >= 0"),
    ("limit_val_batches", 2.0, "float in [0.0, 1.0]"),
    ("limit_val_batches", False, "int >= 0"),
    ("val_every_n_epochs", 0, POSITIVE_INT),
    ("val_every_n_epochs", -1, POSITIVE_INT),
    ("val_every_n_epochs", True, POSITIVE_INT),
    ("val_every_n_steps", 0, POSITIVE_INT),
    ("val_every_n_steps", 1.0, POSITIVE_INT),
    ("num_sanity_val_steps", -2, "-1 (all), 0 (off)"),
    ("num_sanity_val_steps", 1.5, "-1 (all), 0 (off)"),
    ("num_sanity_val_steps", True, "-1 (all), 0 (off)"),
    ("gradient_accumulation_steps", 0, POSITIVE_INT),
    ("gradient_accumulation_steps", -3, POSITIVE_INT),
    ("gradient_accumulation_steps", True, POSITIVE_INT),
    ("gradient_clip_val", 0, "positive number"),
    ("gradient_clip_val", 0.0, "positive number"),
    ("gradient_clip_val", -1.0, "positive number"),
    ("gradient_clip_val", True, "positive number"),
    ("gradient_clip_val", "1.0", "positive number"),
    ("gradient_clip_algorithm", "l2", "'norm', 'value'"),
    ("scheduler_interval", "batch", "'epoch', 'step'"),
    ("mixed_precision", "fp8", "None, 'bf16', 'fp16'"),
    ("mixed_precision", "16-mixed", "None, 'bf16', 'fp16'"),
    ("non_finite_grads", "nan", "'ignore', 'raise', 'skip', 'retry'"),
    ("max_non_finite_retries", 0, POSITIVE_INT),
    ("device", "gpu", "'auto', 'cpu', 'cuda', 'cuda:N' and 'mps'"),
    ("device", "cuda:x", "'auto', 'cpu', 'cuda', 'cuda:N' and 'mps'"),
    ("device", 0, "'auto', 'cpu', 'cuda', 'cuda:N' and 'mps'"),
    ("log_every_n_steps", 0, POSITIVE_INT),
    ("log_every_n_steps", -10, POSITIVE_INT),
    ("log_every_n_steps", True, POSITIVE_INT),
    ("seed", True, "integer or None"),
    ("seed", "42", "integer or None"),
    ("compile_model", 1, "True or False"),
    ("print_epoch_summary", "yes", "True or False"),
    ("root_dir", 3, "path"),
]


@pytest.mark.parametrize(("field", "value", "valid"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_value_raises_config_error_naming_field_value_and_choices(field, value, valid):
    message = _error(**{field: value})
    _assert_names(message, f"DreamTrainerConfig.{field}", repr(value), valid)


def test_config_error_is_a_value_error():
    # Users catching ValueError around config construction keep working.
    with pytest.raises(ValueError):
        DreamTrainerConfig(n_epochs=0)


def test_n_epochs_defaults_to_one_epoch_unless_max_steps_is_given():
    assert DreamTrainerConfig().n_epochs == 1
    assert DreamTrainerConfig(n_epochs=None, max_steps=None).n_epochs == 1
    assert DreamTrainerConfig(max_steps=100).n_epochs is None  # max_steps alone: no epoch limit
    assert DreamTrainerConfig(n_epochs=3, max_steps=100).n_epochs == 3  # both: the first reached ends it


def test_n_epochs_none_with_max_steps_is_valid():
    cfg = DreamTrainerConfig(n_epochs=None, max_steps=10)
    assert cfg.n_epochs is None and cfg.max_steps == 10


@pytest.mark.parametrize("zero", [0, 0.0])
def test_limit_train_batches_zero(zero):
    message = _error(limit_train_batches=zero)
    _assert_names(message, "limit_train_batches", repr(zero), "None for all")


@pytest.mark.parametrize("limit", [0, 0.0, 1, 0.5, 1.0, None])
def test_limit_val_batches_accepts_zero_ints_and_fractions(limit):
    assert DreamTrainerConfig(limit_val_batches=limit).limit_val_batches == limit


def test_retry_needs_no_accumulation():
    message = _error(non_finite_grads="retry", gradient_accumulation_steps=2)
    _assert_names(message, "non_finite_grads", "'retry'", "gradient_accumulation_steps", "2", "'skip'")
    # Each setting alone is fine.
    DreamTrainerConfig(non_finite_grads="retry")
    DreamTrainerConfig(non_finite_grads="skip", gradient_accumulation_steps=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_requested_without_cuda(device):
    message = _error(device=device)
    _assert_names(message, "DreamTrainerConfig.device", repr(device), "not available", "'cpu'")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_mps_requested_without_mps():
    message = _error(device="mps")
    _assert_names(message, "DreamTrainerConfig.device", "'mps'", "not available")


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_valid_devices(device):
    assert DreamTrainerConfig(device=device).device == device


def test_non_callback_in_callbacks():
    # Contract: every field is checked at construction and a bad value raises ConfigError naming it.
    message = _error(callbacks=[RecordingCallback(), object()])
    _assert_names(message, "callbacks", "object", "Callback")


def test_callbacks_not_a_list():
    message = _error(callbacks=RecordingCallback())
    _assert_names(message, "DreamTrainerConfig.callbacks", "RecordingCallback", "list of Callback")


def test_non_logger_in_loggers():
    message = _error(loggers=[MemoryLogger(), "tensorboard"])
    _assert_names(message, "DreamTrainerConfig.loggers", "'tensorboard'", "str", "Logger")


def test_loggers_not_a_list():
    message = _error(loggers=MemoryLogger())
    _assert_names(message, "DreamTrainerConfig.loggers", "MemoryLogger", "list of Logger")


def test_defaults_are_valid_and_lightning_like():
    cfg = DreamTrainerConfig()
    assert cfg.n_epochs == 1
    assert cfg.max_steps is None
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.scheduler_interval == "epoch"
    assert cfg.mixed_precision is None
    assert cfg.callbacks == []
    # Lightning's defaults: TensorBoard (loggers=None), a progress bar, checkpointing every epoch.
    assert cfg.loggers is None and cfg.enable_progress_bar and cfg.enable_checkpointing


def test_default_callback_lists_are_not_shared():
    a, b = DreamTrainerConfig(), DreamTrainerConfig()
    a.callbacks.append(RecordingCallback())
    assert b.callbacks == []


# --- user subclasses -----------------------------------------------------------------------------------
def test_user_subclass_adds_fields():
    cfg = MyConfig(n_epochs=3, learning_rate=0.01)
    assert cfg.learning_rate == 0.01
    assert cfg.n_epochs == 3
    assert MyConfig().learning_rate == 1e-3


def test_user_subclass_is_validated_and_named_in_the_error():
    with pytest.raises(ConfigError) as info:
        MyConfig(n_epochs=0, learning_rate=0.1)
    _assert_names(str(info.value), "MyConfig.n_epochs", "0", POSITIVE_INT)
    with pytest.raises(ConfigError, match="fp8"):
        MyConfig(mixed_precision="fp8")


# --- serialization ---------------------------------------------------------------------------------------
def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True is torch's default


def test_config_survives_torch_save_and_bare_torch_load(tmp_path):
    cfg = DreamTrainerConfig(
        n_epochs=3,
        gradient_clip_val=1.0,
        mixed_precision="bf16",
        callbacks=[RecordingCallback()],
        loggers=[MemoryLogger()],
        root_dir=str(tmp_path),
    )
    path = tmp_path / "ckpt.pt"
    torch.save({"config": cfg, "step": 7}, path)
    loaded = torch.load(path)
    assert loaded["step"] == 7
    restored = loaded["config"]
    assert type(restored) is DreamTrainerConfig
    assert restored == dataclasses.replace(cfg, callbacks=[], loggers=[])
    assert restored.callbacks == [] and restored.loggers == []
    # Saving does not strip the live config.
    assert len(cfg.callbacks) == 1 and len(cfg.loggers) == 1


def test_user_subclass_survives_bare_torch_load():
    cfg = MyConfig(learning_rate=0.25, n_epochs=4, loggers=[MemoryLogger()])
    restored = _roundtrip({"config": cfg})["config"]
    assert type(restored) is MyConfig
    assert restored.learning_rate == 0.25
    assert restored == dataclasses.replace(cfg, loggers=[])


def test_pathlike_root_dir_survives_bare_torch_load(tmp_path):
    cfg = DreamTrainerConfig(root_dir=tmp_path)
    restored = _roundtrip(cfg)
    assert restored.root_dir == str(tmp_path)


def test_to_dict():
    class Silent(Callback):
        pass

    class Quiet(Logger):
        def log_metrics(self, metrics, step):
            pass

    cfg = MyConfig(
        n_epochs=5,
        learning_rate=0.5,
        root_dir=pathlib.Path("some/dir"),
        callbacks=[Silent(), RecordingCallback()],
        loggers=[Quiet()],
    )
    d = cfg.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(MyConfig)}
    assert d["n_epochs"] == 5
    assert d["learning_rate"] == 0.5
    assert d["root_dir"] == str(pathlib.Path("some/dir"))
    assert isinstance(d["root_dir"], str)
    assert d["callbacks"] == ["test_to_dict.<locals>.Silent", "RecordingCallback"]
    assert d["loggers"] == ["test_to_dict.<locals>.Quiet"]
    # Plain values only: it can go through a weights_only load.
    assert _roundtrip(d) == d


# --- unknown fields: a did-you-mean, and Lightning's names mapped ----------------------------------------
def test_lightning_trainer_argument_names_the_field_to_write():
    from dream_trainer.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        DreamTrainerConfig(max_epochs=2)
    message = str(info.value)
    assert "'max_epochs' is Lightning's Trainer argument; here write n_epochs=" in message
    assert "TypeError" not in message


def test_lightning_argument_without_a_field_says_what_to_do_instead():
    from dream_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'benchmark'.*torch\.backends\.cudnn\.benchmark"):
        DreamTrainerConfig(benchmark=True)


def test_misspelt_field_gets_the_closest_name_also_in_a_subclass():
    from dataclasses import dataclass

    from dream_trainer.errors import ConfigError

    @dataclass
    class MyConfig(DreamTrainerConfig):
        learning_rate: float = 0.1

    with pytest.raises(ConfigError, match=r"'n_epoch': did you mean 'n_epochs'"):
        DreamTrainerConfig(n_epoch=3)
    with pytest.raises(
        ConfigError, match=r"MyConfig got unknown field\(s\): 'learning_rat': did you mean 'learning_rate'"
    ):
        MyConfig(learning_rat=0.2)
    assert MyConfig(learning_rate=0.2).learning_rate == 0.2  # known fields are untouched


def test_migration_table_lists_every_lightning_trainer_argument_as_the_error_does():
    from pathlib import Path

    from dream_trainer.lightning.trainer_args import TRAINER_ARGUMENTS, doc_row

    doc = (Path(__file__).parent.parent / "docs" / "migrating-from-lightning.md").read_text()
    missing = [name for name in TRAINER_ARGUMENTS if doc_row(name) not in doc]
    assert missing == [], f"docs/migrating-from-lightning.md lacks the rows of {missing} (see doc_row)"
    fields = {f.name for f in __import__("dataclasses").fields(DreamTrainerConfig)}
    assert {m.field for m in TRAINER_ARGUMENTS.values() if m.field} <= fields


# --- the fields a subclass adds are checked against their annotations ------------------------------------
class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclass
class AnnotatedConfig(DreamTrainerConfig):
    lr: float = 1e-3
    depth: int = 2
    use_bias: bool = True
    name: str | None = None
    kind: Literal["mlp", "cnn"] = "mlp"
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    out_dir: pathlib.Path = pathlib.Path("out")
    mode: Mode = Mode.FAST
    max_len: int = None  # type: ignore[assignment]  # the declared default is the author's choice
    model: NotAName = None  # type: ignore[name-defined]  # noqa: F821  # unresolvable: not checked


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"lr": "3e-4"}, "AnnotatedConfig.lr = '3e-4' is invalid: expected a float, got a str."),
        ({"depth": True}, "AnnotatedConfig.depth = True is invalid: expected an int, got a bool."),
        ({"depth": 2.0}, "AnnotatedConfig.depth = 2.0 is invalid: expected an int, got a float."),
        ({"use_bias": 1}, "AnnotatedConfig.use_bias = 1 is invalid: expected True or False, got an int."),
        ({"name": 3}, "AnnotatedConfig.name = 3 is invalid: expected a str or None, got an int."),
        ({"kind": "rnn"}, "AnnotatedConfig.kind = 'rnn' is invalid: expected one of 'mlp', 'cnn', got a str."),
        ({"sizes": [1, "2"]}, "AnnotatedConfig.sizes = [1, '2'] is invalid: expected a list of int."),
        ({"sizes": (1, 2)}, "AnnotatedConfig.sizes = (1, 2) is invalid: expected a list of int, got a tuple."),
        ({"weights": {"a": "b"}}, "AnnotatedConfig.weights = {'a': 'b'} is invalid: expected a dict of str to float."),
        ({"out_dir": 3}, "AnnotatedConfig.out_dir = 3 is invalid: expected a path (str or pathlib.Path), got an int."),
        (
            {"mode": "fast"},
            "AnnotatedConfig.mode = 'fast' is invalid: expected a member of Mode (Mode.FAST, Mode.SLOW)",
        ),
        ({"max_len": "10"}, "AnnotatedConfig.max_len = '10' is invalid: expected an int, got a str."),
    ],
)
def test_added_fields_are_checked_against_their_annotations(kwargs, expected):
    with pytest.raises(ConfigError) as info:
        AnnotatedConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message and len(message) < 300


def test_added_fields_accept_what_their_annotations_allow():
    cfg = AnnotatedConfig(
        lr=1,  # an int is a float
        name="run",
        kind="cnn",
        sizes=[],
        weights={"a": 1, "b": 0.5},
        out_dir="elsewhere",  # a str is a path
        mode=Mode.SLOW,
        max_len=None,  # the declared default
        model=object(),  # an annotation that cannot be resolved is not checked
    )
    assert cfg.lr == 1 and cfg.out_dir == "elsewhere" and cfg.mode is Mode.SLOW
    assert AnnotatedConfig(max_len=5).max_len == 5


def test_a_long_value_is_shortened_in_the_error():
    with pytest.raises(ConfigError) as info:
        AnnotatedConfig(sizes=[*range(10_000), "x"])
    message = str(info.value)
    assert message.startswith("AnnotatedConfig.sizes = [0, 1, 2, 3, 4, 5, ...] is invalid: expected a list of int")
    assert len(message) < 300


def test_several_unknown_fields_first_line_then_one_per_field():
    with pytest.raises(ConfigError) as info:
        DreamTrainerConfig(max_epochs=2, accumulate_grad_batches=4, benchmark=True, n_epoch=1)
    first, *rest = str(info.value).splitlines()
    assert len(first) < 300
    assert first.startswith("DreamTrainerConfig got 4 unknown field(s): 'max_epochs', 'accumulate_grad_batches'")
    assert rest == [
        "  'max_epochs': 'max_epochs' is Lightning's Trainer argument; here write n_epochs= (the same meaning)",
        "  'accumulate_grad_batches': 'accumulate_grad_batches' is Lightning's Trainer argument; here write "
        "gradient_accumulation_steps= (the same meaning)",
        "  'benchmark': 'benchmark' is Lightning's Trainer argument; here it is not a config field: "
        "set torch.backends.cudnn.benchmark yourself",
        "  'n_epoch': did you mean 'n_epochs'",
    ]


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_torchrun_processes_on_a_node_than_gpus_is_refused_at_construction(device, tmp_path, monkeypatch):
    """Two processes of one node on one GPU: NCCL refused them only at the first collective ("Duplicate GPU
    detected", seen on an H100 with --nproc_per_node 2). The trainer says what to change before any work."""
    from conftest import TinyTrainer, quiet_config

    from dream_trainer import MisconfigurationError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError) as info:
        TinyTrainer(quiet_config(tmp_path, device=device))
    first_line = str(info.value).splitlines()[0]
    _assert_names(first_line, f"device={device!r}", "2 processes", "1 CUDA device", "--nproc_per_node 1", "'cpu'")
    assert len(first_line) < 300
