"""Registry: register/get/build, the error listing what is registered, dotted paths, recursive builds."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from dream_trainer.callbacks import EarlyStopping, LearningRateMonitor
from dream_trainer.errors import ConfigError
from dream_trainer.loggers import CSVLogger
from dream_trainer.registry import (
    CALLBACKS,
    DATASETS,
    LOGGERS,
    MODELS,
    OPTIMIZERS,
    SCHEDULERS,
    Registry,
    RegistryError,
    build_from_cfg,
    build_nested,
    locate,
)


@pytest.fixture
def clean_globals():
    """Tests may register into the global registries; put them back afterwards."""
    saved = {reg: dict(reg._entries) for reg in (MODELS, DATASETS)}
    yield
    for reg, entries in saved.items():
        reg._entries.clear()
        reg._entries.update(entries)


class Net(nn.Module):
    def __init__(self, width: int = 2, act: nn.Module | None = None) -> None:
        super().__init__()
        self.width = width
        self.act = act


def test_register_forms_list_and_contains() -> None:
    reg: Registry[object] = Registry("things")

    @reg.register
    class A:
        pass

    @reg.register()
    class B:
        pass

    @reg.register("see")
    class C:
        pass

    @reg.register(name="dee")
    class D:
        pass

    def make_e() -> str:
        return "e"

    assert reg.register(make_e) is make_e  # direct call, returns the object
    assert reg.list() == sorted(["A", "B", "see", "dee", "make_e"])
    assert "A" in reg and "see" in reg and "C" not in reg and 3 not in reg
    assert len(reg) == 5 and list(reg) == reg.list()
    assert reg.get("see") is C and reg.get("dee") is D and reg.get("A") is A and reg.get("B") is B
    assert reg.build({"type": "make_e"}) == "e"
    assert "things" in repr(reg)


def test_duplicate_names() -> None:
    reg: Registry[object] = Registry("things")
    reg.register(Net)
    reg.register(Net)  # the same object again: fine

    class Other:
        pass

    with pytest.raises(ValueError, match=r"'Net' is already registered in things"):
        reg.register(Other, name="Net")
    reg.register(Other, name="Net", force=True)
    assert reg.get("Net") is Other
    with pytest.raises(TypeError):
        reg.register(42)  # type: ignore[call-overload]


def test_same_definition_reregisters() -> None:
    # A module executed twice (the CLI importing a file, a notebook cell re-run) defines a new class
    # object with the same module and qualname: that replaces the entry instead of failing.
    reg: Registry[object] = Registry("things")
    first = type("Thing", (), {"__module__": "somewhere"})
    second = type("Thing", (), {"__module__": "somewhere"})
    reg.register(first)
    reg.register(second)
    assert reg.get("Thing") is second


def test_unknown_name_lists_registered_and_closest() -> None:
    reg: Registry[object] = Registry("models")
    reg.register(Net, name="ResNet")
    reg.register(Net, name="ViT")
    with pytest.raises(RegistryError) as info:
        reg.get("ResNt")
    msg = str(info.value)
    assert isinstance(info.value, KeyError)
    assert "'ResNt' is not registered in models" in msg
    assert "Did you mean 'ResNet'?" in msg
    assert "Registered: ResNet, ViT" in msg
    assert msg.endswith("works too.")  # not KeyError's quoted repr of the message
    with pytest.raises(RegistryError, match="Did you mean 'ViT'"):
        reg.get("vit")  # case-insensitive suggestion
    with pytest.raises(RegistryError, match=r"\(nothing yet\)"):
        Registry("empty").get("x")


def test_build_with_extra_and_bad_arguments() -> None:
    reg: Registry[nn.Module] = Registry("models")
    reg.register(Net)
    net = reg.build({"type": "Net", "width": 3})
    assert isinstance(net, Net) and net.width == 3
    assert reg.build({"type": "Net", "width": 3}, width=5).width == 5  # extra wins
    cfg = {"type": "Net", "width": 3}
    reg.build(cfg)
    assert cfg == {"type": "Net", "width": 3}  # the config is not consumed
    with pytest.raises(ConfigError, match=r"cannot build Net: .*'depth'.*It accepts: width, act"):
        reg.build({"type": "Net", "depth": 3})
    with pytest.raises(ConfigError, match="no 'type' key"):
        reg.build({"width": 3})
    with pytest.raises(ConfigError, match="expected a mapping"):
        reg.build("Net")  # type: ignore[arg-type]
    assert isinstance(reg.build({"type": Net}), Net)  # the class itself


def test_dotted_paths() -> None:
    assert locate("torch.optim.AdamW") is torch.optim.AdamW
    assert locate("collections:OrderedDict") is collections.OrderedDict
    assert locate("torch.nn.modules.linear.Linear") is nn.Linear
    assert MODELS.get("torch.nn.Linear") is nn.Linear
    lin = MODELS.build({"type": "torch.nn.Linear", "in_features": 2, "out_features": 1})
    assert isinstance(lin, nn.Linear)
    with pytest.raises(RegistryError, match="has no attribute 'AdamX'"):
        locate("torch.optim.AdamX")
    with pytest.raises(RegistryError, match="no module"):
        locate("no_such_package_xyz.Thing")
    with pytest.raises(RegistryError, match="there is no module 'no_such_package_xyz'"):
        locate("no_such_package_xyz:Thing")
    assert "torch.optim.AdamW" not in OPTIMIZERS.list()  # a dotted lookup does not register


def test_builtin_registries_are_lazy_and_complete() -> None:
    for name in ("SGD", "Adam", "AdamW", "RMSprop"):
        assert name in OPTIMIZERS
    assert "Optimizer" not in OPTIMIZERS
    for name in ("StepLR", "CosineAnnealingLR", "OneCycleLR", "ReduceLROnPlateau"):
        assert name in SCHEDULERS
    assert "EarlyStopping" in CALLBACKS and "ModelCheckpoint" in CALLBACKS
    assert "CSVLogger" in LOGGERS and "TensorBoardLogger" in LOGGERS

    model = nn.Linear(2, 1)
    opt = OPTIMIZERS.build({"type": "AdamW", "lr": 3e-4}, params=model.parameters())
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 3e-4
    sched = SCHEDULERS.build({"type": "StepLR", "step_size": 2}, optimizer=opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    cb = CALLBACKS.build({"type": "EarlyStopping", "monitor": "val_acc", "mode": "max", "patience": 5})
    assert isinstance(cb, EarlyStopping) and cb.patience == 5
    assert isinstance(LOGGERS.build({"type": "CSVLogger"}), CSVLogger)


def test_builtin_callbacks_and_loggers_are_the_packages_own_lists() -> None:
    import dream_trainer.callbacks as callbacks
    import dream_trainer.loggers as loggers
    from dream_trainer.callbacks.base import Callback
    from dream_trainer.loggers.base import Logger

    for registry, package, base in ((CALLBACKS, callbacks, Callback), (LOGGERS, loggers, Logger)):
        assert registry.list() == sorted(package.BUILTINS)
        for name in package.BUILTINS:
            obj = registry.get(name)
            assert obj is getattr(package, name) and issubclass(obj, base), name
    assert "Callback" not in CALLBACKS and "ProgressBarBase" not in CALLBACKS and "Logger" not in LOGGERS


def test_register_lazy_imports_on_first_get() -> None:
    reg: Registry[object] = Registry("things", {"Dict": "collections.OrderedDict"})
    reg.register_lazy("Counter", "collections:Counter")
    assert reg.list() == ["Counter", "Dict"] and "Counter" in reg
    assert reg._entries == {}  # nothing imported yet
    assert reg.get("Counter") is collections.Counter and reg.get("Dict") is collections.OrderedDict


def test_recursive_build(clean_globals) -> None:
    MODELS.register(Net, name="RecNet")
    cfg = {"type": "RecNet", "width": 4, "act": {"type": "torch.nn.ReLU"}}
    net = MODELS.build(cfg)
    assert isinstance(net.act, nn.ReLU)
    kept = MODELS.build(cfg, recursive=False)
    assert kept.act == {"type": "torch.nn.ReLU"}

    # Inside lists and plain dicts, and names from other registries (here CALLBACKS).
    built = build_nested({"cbs": [{"type": "LearningRateMonitor"}, 1], "plain": {"a": 1}})
    assert isinstance(built["cbs"][0], LearningRateMonitor) and built["cbs"][1] == 1
    assert built["plain"] == {"a": 1}
    seq = build_nested({"type": "torch.nn.Sequential"})
    assert isinstance(seq, nn.Sequential)

    # Seed 002's builder: one call, any registry; extra arguments such as the parameters.
    model = build_from_cfg({"type": "RecNet", "width": 2}, recursive=True)
    assert isinstance(model, Net)
    lin = nn.Linear(2, 1)
    opt = build_from_cfg({"type": "torch.optim.SGD", "lr": 0.1}, params=lin.parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert isinstance(build_from_cfg({"type": "SGD", "lr": 0.1}, OPTIMIZERS, params=lin.parameters()), torch.optim.SGD)


def test_class_path_style() -> None:
    cb = CALLBACKS.build({"class_path": "EarlyStopping", "init_args": {"patience": 7}})
    assert isinstance(cb, EarlyStopping) and cb.patience == 7
    cb = build_nested({"class_path": "dream_trainer.callbacks.EarlyStopping", "init_args": {"patience": 2}})
    assert cb.patience == 2


def test_build_from_cfg_errors(clean_globals) -> None:
    with pytest.raises(RegistryError, match=r"'AdamWW' is not registered in any registry\. Did you mean 'AdamW'"):
        build_from_cfg({"type": "AdamWW"})

    class A:
        pass

    class B:
        pass

    MODELS.register(A, name="Twin")
    DATASETS.register(B, name="Twin")
    with pytest.raises(RegistryError, match="several registries"):
        build_from_cfg({"type": "Twin"})
    assert isinstance(MODELS.build({"type": "Twin"}), A)  # the registry asked comes first
    assert isinstance(DATASETS.build({"type": "Twin"}), B)


# --- a config's names resolve to classes: nothing else is ever called ----------------------------------
MARKER_MODULE = """
from pathlib import Path

CONSTANT = "not a class"


def touch(path):
    Path(path).write_text("called")
"""


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """A module `registry_marker_mod` whose function `touch(path)` writes a file: whether it ran shows."""
    (tmp_path / "registry_marker_mod.py").write_text(MARKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "CALLED"


@pytest.mark.parametrize(
    ("cfg_type", "what"),
    [
        ("registry_marker_mod.touch", "a function"),
        ("registry_marker_mod:touch", "a function"),
        ("registry_marker_mod.CONSTANT", "a str object"),
        ("os.path", "a module"),
        ("os.system", "a function"),
    ],
)
def test_a_dotted_type_that_is_not_a_class_is_refused_uncalled(marker_module, cfg_type, what) -> None:
    harmless = {"path": str(marker_module)} if "marker" in cfg_type else {"command": "exit 0"}
    expected = f"'{cfg_type}' names {what}, not a class: a config's 'type' must be a class or a registered name"
    for build in (
        lambda: build_from_cfg({"type": cfg_type, **harmless}),
        lambda: MODELS.build({"type": cfg_type, **harmless}),
        lambda: build_nested({"cbs": [{"class_path": cfg_type, "init_args": harmless}]}),
        lambda: CALLBACKS.get(cfg_type),
    ):
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value).startswith(expected), str(info.value)
    assert not marker_module.exists()


def test_an_outer_non_class_is_refused_before_its_nested_entries_are_built(marker_module, clean_globals) -> None:
    built = []

    @MODELS.register(name="Recorder")
    class Recorder:
        def __init__(self) -> None:
            built.append(self)

    with pytest.raises(ConfigError, match="names a function, not a class"):
        build_from_cfg({"type": "registry_marker_mod.touch", "path": {"type": "Recorder"}})
    assert built == [] and not marker_module.exists()


def test_a_registered_function_still_builds(marker_module, clean_globals) -> None:
    import registry_marker_mod

    MODELS.register(registry_marker_mod.touch, name="touch_file")  # code registers it: a config may name it
    MODELS.build({"type": "touch_file", "path": str(marker_module)})
    assert marker_module.read_text() == "called"


def test_unknown_name_first_line_is_short_with_the_listing_below() -> None:
    with pytest.raises(RegistryError) as info:
        build_from_cfg({"type": "AdamWW"})
    first, *rest = str(info.value).splitlines()
    assert first == (
        "'AdamWW' is not registered in any registry. Did you mean 'AdamW'? A dotted import path "
        "(e.g. 'torch.nn.Linear') works too."
    )
    assert len(rest) == 1 and rest[0].startswith("Registered: models: ") and "optimizers: ASGD, " in rest[0]
    with pytest.raises(RegistryError) as info:
        CALLBACKS.get("EarlyStop")
    first, *rest = str(info.value).splitlines()
    assert first.startswith("'EarlyStop' is not registered in callbacks. Did you mean 'EarlyStopping'?")
    assert len(first) < 300 and rest[0].startswith("Registered: BackboneFinetuning, ")
