"""`dream_trainer.hook_spec`: the one declaration of the hooks, and everything checked against it."""

from __future__ import annotations

import ast
import inspect
import pydoc
from pathlib import Path
from typing import Any

import pytest

import dream_trainer
from dream_trainer import callbacks
from dream_trainer.callbacks.base import Callback
from dream_trainer.callbacks.bus import CallbackBus, empty_bus
from dream_trainer.hook_spec import HOOK_SPECS, HOOKS, hook_defaults, hook_mismatches, overrides_hook
from dream_trainer.mixins.hooks import HooksMixin

# The user contract (docs/DESIGN): Lightning's names, in this relative order. Test and predict hooks
# sit between on_fit_end and on_save_checkpoint.
CONTRACT_ORDER = [
    "setup",
    "on_fit_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_exception",
    "teardown",
]


# --- the declaration ------------------------------------------------------------------------------------
def test_hooks_is_the_spec_in_order_and_keeps_the_contract():
    assert tuple(s.name for s in HOOK_SPECS) == HOOKS
    assert callbacks.HOOKS is HOOKS
    assert len(set(HOOKS)) == len(HOOKS)
    assert [h for h in HOOKS if h in CONTRACT_ORDER] == CONTRACT_ORDER
    assert [h for h in HOOKS if h not in CONTRACT_ORDER] == [
        f"on_{stage}_{when}"
        for stage in ("test", "predict")
        for when in ("start", "epoch_start", "batch_start", "batch_end", "epoch_end", "end")
    ]


def test_spec_arguments_are_the_documented_ones():
    args = {s.name: s.args for s in HOOK_SPECS}
    assert args["on_train_batch_start"] == ("batch", "batch_idx")
    assert args["on_train_batch_end"] == ("outputs", "batch", "batch_idx")
    assert args["on_before_zero_grad"] == args["on_before_optimizer_step"] == ("optimizer",)
    assert args["on_before_backward"] == ("loss",)
    assert args["on_save_checkpoint"] == args["on_load_checkpoint"] == ("checkpoint",)
    assert args["on_exception"] == ("exception",)
    assert args["setup"] == args["teardown"] == ("stage",)
    assert dict(HOOK_SPECS[HOOKS.index("on_save_checkpoint")].params) == {"checkpoint": "dict[str, Any]"}


def test_every_spec_has_a_one_line_doc():
    for spec in HOOK_SPECS:
        assert spec.doc and "\n" not in spec.doc and spec.doc.endswith("."), spec.name


# --- the two default classes match it exactly -----------------------------------------------------------
@pytest.mark.parametrize(("cls", "receiver"), [(Callback, "callback"), (HooksMixin, "trainer")])
def test_default_classes_match_the_spec(cls, receiver):
    assert hook_mismatches(cls, receiver) == []
    defined = [name for name in vars(cls) if name in HOOKS]
    assert defined == list(HOOKS)
    lead = ["self", "trainer"] if receiver == "callback" else ["self"]
    for spec in HOOK_SPECS:
        fn = vars(cls)[spec.name]
        assert list(inspect.signature(fn).parameters) == [*lead, *spec.args]
        assert inspect.getdoc(fn).startswith(spec.doc)


def test_real_signatures_and_docs_for_help_and_tools():
    sig = inspect.signature(Callback.on_train_batch_end)
    assert str(sig) == "(self, trainer: 'TrainerProtocol', outputs: 'Any', batch: 'Any', batch_idx: 'int') -> 'None'"
    assert str(inspect.signature(HooksMixin.on_save_checkpoint)) == "(self, checkpoint: 'dict[str, Any]') -> 'None'"
    text = pydoc.render_doc(Callback, renderer=pydoc.plaintext)
    for spec in HOOK_SPECS:
        assert spec.name in text and spec.doc in " ".join(text.split()), spec.name


# --- the checker catches every kind of drift ------------------------------------------------------------
def _callback_namespace() -> dict[str, Any]:
    """Copies of Callback's hook methods, to break one at a time."""
    return {name: vars(Callback)[name] for name in HOOKS}


def _checked(namespace: dict[str, Any]) -> list[str]:
    return hook_mismatches(type("Broken", (), namespace), "callback")


def test_checker_reports_missing_extra_and_reordered_hooks():
    ns = _callback_namespace()
    del ns["on_after_backward"]
    assert _checked(ns) == ["missing hooks: on_after_backward"]

    ns = _callback_namespace()
    ns["on_train_batch_ends"] = lambda self, trainer: None
    assert _checked(ns) == ["methods named like hooks that HOOK_SPECS lacks: on_train_batch_ends"]

    ns = _callback_namespace()
    ns = {"teardown": ns.pop("teardown"), **ns}
    (problem,) = _checked(ns)
    assert problem.startswith("hooks out of firing order: teardown, setup")


def test_checker_reports_arguments_annotations_defaults_and_docs():
    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, idx: int) -> None:  # noqa: F821
        """After `training_step` and any optimizer steps it caused; `outputs` is what it returned."""

    def on_before_backward(self, trainer: TrainerProtocol, loss: float) -> None:  # noqa: F821
        """Before `backward`, with the loss as `training_step` computed it (unscaled)."""

    def on_fit_start(self, trainer: TrainerProtocol, extra: int = 0) -> None:  # noqa: F821
        """After setup (and resume), before the sanity check."""

    def on_fit_end(self, trainer: TrainerProtocol) -> None:  # noqa: F821
        """At the end."""

    ns = _callback_namespace()
    ns.update(
        on_train_batch_end=on_train_batch_end,
        on_before_backward=on_before_backward,
        on_fit_start=on_fit_start,
        on_fit_end=on_fit_end,
    )
    problems = _checked(ns)
    assert len(problems) == 5, problems
    assert problems[0].startswith("on_fit_start(") and "should take (self, trainer: TrainerProtocol)" in problems[0]
    assert problems[1].startswith("on_fit_start(") and "without defaults" in problems[1]
    assert problems[2].startswith("on_before_backward(") and "loss: torch.Tensor" in problems[2]
    assert problems[3].startswith("on_train_batch_end(") and "batch_idx: int" in problems[3]
    assert problems[4] == (
        "on_fit_end's docstring should start with 'At the very end of a successful `fit()`.', not 'At the end.'"
    )


def test_trainer_receiver_takes_no_trainer_argument():
    ns = {name: vars(HooksMixin)[name] for name in HOOKS}
    assert hook_mismatches(type("T", (), ns), "trainer") == []
    assert hook_mismatches(type("T", (), ns), "callback") != []


def test_hook_defaults_refuses_a_class_that_drifted():
    ns = _callback_namespace()
    del ns["teardown"]
    with pytest.raises(
        TypeError, match=r"does not match dream_trainer.hook_spec.HOOK_SPECS:\n  missing hooks: teardown"
    ):
        hook_defaults("callback")(type("Broken", (), ns))


# --- the bus: per-hook tuples from the spec, overrides judged without the trainer class -----------------
class FakeTrainer(HooksMixin):
    """Not a DreamTrainer: the bus only needs an object with the trainer's hook methods."""

    def on_train_epoch_end(self) -> None:
        pass


class EpochCallback(Callback):
    def on_train_epoch_end(self, trainer: Any) -> None:
        pass


def test_bus_has_one_tuple_per_spec_and_dispatches_only_overrides():
    trainer, cb = FakeTrainer(), EpochCallback()
    bus = CallbackBus(trainer, [cb, Callback()])
    assert all(isinstance(getattr(bus, name), tuple) for name in HOOKS)
    assert [name for name in HOOKS if getattr(bus, name)] == ["on_train_epoch_end"]
    first, second = bus.on_train_epoch_end
    assert first.func == cb.on_train_epoch_end and first.args == (trainer,)  # callbacks first
    assert second == trainer.on_train_epoch_end  # then the trainer's own
    empty = empty_bus()
    assert all(getattr(empty, name) == () for name in HOOKS)


def test_overrides_hook():
    assert not overrides_hook(Callback(), "on_fit_start")
    assert overrides_hook(EpochCallback(), "on_train_epoch_end")
    assert not overrides_hook(EpochCallback(), "on_fit_start")
    assert overrides_hook(FakeTrainer(), "on_train_epoch_end")
    assert not overrides_hook(FakeTrainer(), "on_train_start")
    assert not overrides_hook(object(), "on_train_start")  # no such method at all: nothing to call

    class StaticHook(Callback):
        on_fit_start = staticmethod(lambda trainer: None)

    assert overrides_hook(StaticHook(), "on_fit_start")


def test_a_mixin_that_defines_a_hook_is_dispatched():
    """The trainer's hook counts as overridden wherever in its MRO it is defined, not only on the
    user's subclass (comparing with the trainer class would have skipped a mixin's)."""

    class Mixin:
        def on_train_start(self) -> None:
            pass

    class Trainer(Mixin, HooksMixin):
        pass

    bus = CallbackBus(Trainer(), [])
    assert len(bus.on_train_start) == 1


def test_the_trainer_class_itself_dispatches_no_hook():
    """Only a user's override costs a call: none of DreamTrainer's own classes defines a hook."""
    from dream_trainer.trainer import DreamTrainer

    bare = DreamTrainer.__new__(DreamTrainer)
    assert [name for name in HOOKS if overrides_hook(bare, name)] == []


# --- where each hook fires ------------------------------------------------------------------------------
_FIRING_METHODS = {"fire", "fire_safely"}


def _is_bus(node: ast.expr) -> bool:
    """`bus`, `self._bus`, `trainer._bus`: the expressions the package holds the bus in."""
    if isinstance(node, ast.Name):
        return node.id == "bus"
    return isinstance(node, ast.Attribute) and node.attr == "_bus"


def _scan(sources: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """For each hook, where `sources` (file name -> code) fire it by literal name (`bus.fire("x", ...)`,
    `bus.fire_safely("x", ...)`, or reading its tuple `bus.x`); and every firing by a computed name."""
    fired: dict[str, list[str]] = {}
    computed: list[str] = []
    for file, code in sources.items():
        for node in ast.walk(ast.parse(code, file)):
            where = f"{file}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                func, first = node.func, node.args[0] if node.args else None
                if isinstance(func, ast.Attribute) and func.attr in _FIRING_METHODS:
                    if isinstance(first, ast.Constant) and first.value in HOOKS:
                        fired.setdefault(first.value, []).append(where)
                    else:
                        computed.append(f"{where}: {ast.unparse(node)}")
                elif isinstance(func, ast.Name) and func.id == "getattr" and first is not None and _is_bus(first):
                    computed.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and node.attr in HOOKS and _is_bus(node.value):
                fired.setdefault(node.attr, []).append(where)
    return fired, computed


def test_every_hook_fires_by_its_literal_name():
    """`grep on_test_end dream_trainer/` finds where `on_test_end` fires: every hook of the spec is
    named literally at a call into the bus, and no hook is fired by a name computed at run time."""
    package = Path(dream_trainer.__file__).parent
    sources = {str(p.relative_to(package.parent)): p.read_text(encoding="utf-8") for p in package.rglob("*.py")}
    fired, computed = _scan(sources)
    assert computed == []
    assert [name for name in HOOKS if name not in fired] == []
    assert any(site.startswith("dream_trainer/mixins/evaluation.py") for site in fired["on_test_end"])
    assert any(site.startswith("dream_trainer/mixins/step.py") for site in fired["on_train_batch_end"])


def test_the_scan_flags_computed_hook_names():
    code = """
bus.fire("on_fit_end")
for fn in self._bus.on_train_batch_end:
    fn(outputs, batch, batch_idx)
bus.fire(f"on_{stage}_end")
self._bus.fire_safely(hook, exc)
getattr(trainer._bus, f"on_{stage}_batch_start")
bus.fire("on_fit_ends")
"""
    fired, computed = _scan({"x.py": code})
    assert fired == {"on_fit_end": ["x.py:2"], "on_train_batch_end": ["x.py:3"]}
    assert [site.split(":")[1] for site in computed] == ["5", "6", "7", "8"]


def test_bus_fire_runs_the_hook_in_order_with_its_arguments():
    calls: list[tuple[str, Any]] = []

    class Recorder(Callback):
        def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
            calls.append(("callback", checkpoint))

    class Trainer(HooksMixin):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            calls.append(("trainer", checkpoint))

    bus = CallbackBus(Trainer(), [Recorder()])
    bus.fire("on_save_checkpoint", {"a": 1})
    bus.fire("on_fit_start")  # nobody overrides it: nothing runs
    assert calls == [("callback", {"a": 1}), ("trainer", {"a": 1})]
