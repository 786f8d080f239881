"""The hooks: declared once, by `Callback`'s methods (`HOOK_SPECS` is read from them), and everything
derived from or checked against that declaration (`dream_trainer.hook_spec`)."""

from __future__ import annotations

import ast
import inspect
import os
import pydoc
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import dream_trainer
from dream_trainer import callbacks
from dream_trainer.callbacks.base import HOOK_SPECS, HOOKS, Callback
from dream_trainer.callbacks.bus import CallbackBus, empty_bus
from dream_trainer.hook_spec import declare_hooks, hook_defaults, hook_mismatches, is_hook_name, overrides_hook
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
    # The declaration: Callback's methods named like hooks, in the order written.
    assert list(HOOKS) == [n for n, v in vars(Callback).items() if inspect.isfunction(v) and is_hook_name(n)]
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


def test_declare_hooks_reads_each_method_as_written():
    """A hook written on the declaring class is a spec: its name, arguments after `trainer` with their
    annotations, return annotation and summary line, at its place in the order written."""

    def on_new_hook(self, trainer: TrainerProtocol, value: int) -> int | None:  # noqa: F821
        """Between two hooks, with a value.

        A second paragraph is detail, not the summary."""

    ns = _callback_namespace()
    ns = {**dict(list(ns.items())[:6]), "on_new_hook": on_new_hook, **dict(list(ns.items())[6:])}
    ns["state_dict"] = lambda self: {}  # not named like a hook: not one
    specs = declare_hooks(type("Declaring", (), ns))
    names = [spec.name for spec in specs]
    assert names == [*HOOKS[:6], "on_new_hook", *HOOKS[6:]]
    new = specs[6]
    assert (new.params, new.returns, new.doc) == ((("value", "int"),), "int | None", "Between two hooks, with a value.")
    # The trainer's defaults are checked against the declaration: without the new hook, they fail.
    assert hook_mismatches(HooksMixin, specs, "trainer") == ["missing hooks: on_new_hook"]


def test_declare_hooks_refuses_a_method_the_bus_cannot_call():
    def on_fit_start(self) -> None:  # no trainer
        """After setup (and resume), before the sanity check."""

    def on_before_backward(self, trainer: TrainerProtocol, loss, scale: float = 1.0) -> None:  # noqa: F821
        """Before `backward`, with the loss as `training_step` computed it (unscaled)."""

    ns = _callback_namespace()
    ns.update(on_fit_start=on_fit_start, on_before_backward=on_before_backward, on_train_end=staticmethod(print))
    with pytest.raises(TypeError, match=r"Declaring declares the hooks: write each as a plain method") as info:
        declare_hooks(type("Declaring", (), ns))
    problems = str(info.value).split("\n  ")[1:]
    assert len(problems) == 4, problems
    assert problems[0] == "on_fit_start(self) -> 'None' should start with (self, trainer: TrainerProtocol)"
    assert problems[1].startswith("on_before_backward(") and "without defaults" in problems[1]
    assert problems[2].startswith("on_before_backward(") and "should annotate every argument" in problems[2]
    assert problems[3] == "on_train_end should be a plain method, not staticmethod"


_NEW_HOOK = '''
    def on_new_hook(self, {trainer}value: int) -> None:
        """Between the epoch's start and its first batch, with a value."""
'''

_NEW_ROW = '    "on_new_hook": Ours("on_new_hook", _SAME),\n'

_CHECK_NEW_HOOK = """
import dream_trainer
from dream_trainer import CallbackHookError, LambdaCallback
from dream_trainer.callbacks import HOOKS, Callback
from dream_trainer.callbacks.bus import CallbackBus, CallbackList, empty_bus
from dream_trainer.hook_spec import overrides_hook
from dream_trainer.mixins.hooks import HooksMixin

assert dream_trainer.__file__.startswith({root!r}), dream_trainer.__file__
assert HOOKS.index("on_new_hook") == HOOKS.index("on_train_epoch_start") + 1
calls = []

class NewHook(Callback):
    def on_new_hook(self, trainer, value):
        calls.append(("callback", value))

class Trainer(HooksMixin):
    def on_new_hook(self, value):
        calls.append(("trainer", value))

assert not overrides_hook(Callback(), "on_new_hook") and not overrides_hook(HooksMixin(), "on_new_hook")
bus = CallbackBus(Trainer(), CallbackList([NewHook(), Callback()]))
assert len(bus.on_new_hook) == 2 and CallbackBus(HooksMixin(), [Callback()]).on_new_hook == ()
bus.fire("on_new_hook", 3)
for fn in bus.on_new_hook:
    fn(4)
assert calls == [("callback", 3), ("trainer", 3), ("callback", 4), ("trainer", 4)], calls
assert empty_bus().on_new_hook == ()
assert not hasattr(CallbackBus, "__getattr__")  # the bus's per-hook tuples are plain instance attributes
LambdaCallback(on_new_hook=lambda trainer, value: None)

class Misspelt(Callback):
    def on_new_hok(self, trainer, value):
        pass

class Lightning(Callback):
    def on_new_hook(self, trainer, pl_module, value):
        pass

expected = [(Misspelt, "did you mean `on_new_hook`?"), (Lightning, "expected on_new_hook(self, trainer, value: int)")]
for cls, says in expected:
    try:
        CallbackList([cls()])
    except CallbackHookError as exc:
        assert says in str(exc), str(exc)
    else:
        raise AssertionError(cls)
print("ok")
"""


def test_a_new_hook_is_written_on_callback_and_hooks_mixin_and_reaches_the_bus(tmp_path):
    """Adding a hook is writing its method on `Callback` and on `HooksMixin` (and its row in the
    Lightning names table): in a copy of the package with only those edits, it is a hook in `HOOKS` at
    its place, both classes' methods are no-op defaults the bus skips, overrides are dispatched
    (callbacks first, by `fire` and by the tuple), and attaching a callback with the hook misspelt, or
    with Lightning's `pl_module`, fails."""
    package = Path(dream_trainer.__file__).parent
    copy = tmp_path / "dream_trainer"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    epoch_start = '"""At the start of each training epoch."""\n'
    edits = [
        ("callbacks/base.py", epoch_start, _NEW_HOOK.format(trainer="trainer: TrainerProtocol, ")),
        ("mixins/hooks.py", epoch_start, _NEW_HOOK.format(trainer="")),
        ("lightning/names.py", '    "on_train_epoch_start": Ours("on_train_epoch_start", _SAME),\n', _NEW_ROW),
    ]
    for file, anchor, added in edits:
        path = copy / file
        text = path.read_text(encoding="utf-8")
        assert text.count(anchor) == 1, file
        path.write_text(text.replace(anchor, anchor + added), encoding="utf-8")
    script = _CHECK_NEW_HOOK.format(root=str(copy))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _stripped(cls: type) -> dict[str, Any]:
    """Copies of `cls`'s hook methods without their docstrings, as `python -OO` compiles them."""
    out: dict[str, Any] = {}
    for name in HOOKS:
        fn = vars(cls)[name]
        copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        copy.__annotations__ = dict(fn.__annotations__)
        copy.__doc__ = None
        out[name] = copy
    return out


def test_the_hooks_declare_and_check_under_python_OO():
    """`python -OO` strips docstrings: the summaries are then empty in the declaration and in the
    trainer's defaults alike, so importing dream_trainer still passes the check."""
    specs = declare_hooks(type("Callback", (), _stripped(Callback)))
    assert [spec.name for spec in specs] == list(HOOKS)
    assert {spec.doc for spec in specs} == {""}
    trainer_defaults = type("HooksMixin", (), _stripped(HooksMixin))
    assert hook_defaults(specs, "trainer")(trainer_defaults) is trainer_defaults


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# --- the two default classes match it exactly -----------------------------------------------------------
@pytest.mark.parametrize(("cls", "receiver"), [(Callback, "callback"), (HooksMixin, "trainer")])
def test_default_classes_match_the_spec(cls, receiver):
    assert hook_mismatches(cls, HOOK_SPECS, receiver) == []
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
    return hook_mismatches(type("Broken", (), namespace), HOOK_SPECS, "callback")


def test_checker_reports_missing_extra_and_reordered_hooks():
    ns = _callback_namespace()
    del ns["on_after_backward"]
    assert _checked(ns) == ["missing hooks: on_after_backward"]

    ns = _callback_namespace()
    ns["on_train_batch_ends"] = lambda self, trainer: None
    assert _checked(ns) == ["methods named like hooks that Callback does not declare: on_train_batch_ends"]

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
    assert hook_mismatches(type("T", (), ns), HOOK_SPECS, "trainer") == []
    assert hook_mismatches(type("T", (), ns), HOOK_SPECS, "callback") != []


def test_hook_defaults_refuses_a_class_that_drifted():
    ns = _callback_namespace()
    del ns["teardown"]
    with pytest.raises(TypeError, match=r"does not match the hooks Callback declares.*:\n  missing hooks: teardown"):
        hook_defaults(HOOK_SPECS, "callback")(type("Broken", (), ns))


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
    # Plain instance attributes: a class `__getattr__` would stop CPython specialising the reads.
    assert not hasattr(CallbackBus, "__getattr__") and set(HOOKS) <= set(vars(bus))


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


# What the package may read on a bus besides a hook's tuple: its methods and other attributes.
_BUS_MEMBERS = (set(dir(CallbackBus)) | set(vars(empty_bus()))) - set(HOOKS)


def _scan(sources: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """For each hook, where `sources` (file name -> code) fire it by literal name (`bus.fire("x", ...)`,
    `bus.fire_safely("x", ...)`, or reading its tuple `bus.x`); and every firing by a computed name or
    by a name that is not a hook (`bus.fire("on_fit_ends")`, `bus.on_fit_ends`: the type checker takes
    any attribute of the bus, so this scan is what catches a misspelt one)."""
    fired: dict[str, list[str]] = {}
    wrong: list[str] = []
    for file, code in sources.items():
        for node in ast.walk(ast.parse(code, file)):
            where = f"{file}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                func, first = node.func, node.args[0] if node.args else None
                if isinstance(func, ast.Attribute) and func.attr in _FIRING_METHODS:
                    if isinstance(first, ast.Constant) and first.value in HOOKS:
                        fired.setdefault(first.value, []).append(where)
                    else:
                        wrong.append(f"{where}: {ast.unparse(node)}")
                elif isinstance(func, ast.Name) and func.id == "getattr" and first is not None and _is_bus(first):
                    wrong.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and _is_bus(node.value):
                if node.attr in HOOKS:
                    fired.setdefault(node.attr, []).append(where)
                elif node.attr not in _BUS_MEMBERS:
                    wrong.append(f"{where}: {ast.unparse(node)}")
    return fired, wrong


def test_every_hook_fires_by_its_literal_name():
    """`grep on_test_end dream_trainer/` finds where `on_test_end` fires: every hook is named literally
    at a call into the bus, no hook is fired by a name computed at run time, and no name read from the
    bus is neither a hook nor one of its members."""
    package = Path(dream_trainer.__file__).parent
    sources = {str(p.relative_to(package.parent)): p.read_text(encoding="utf-8") for p in package.rglob("*.py")}
    fired, wrong = _scan(sources)
    assert wrong == []
    assert [name for name in HOOKS if name not in fired] == []
    assert any(site.startswith("dream_trainer/mixins/evaluation.py") for site in fired["on_test_end"])
    assert any(site.startswith("dream_trainer/mixins/step.py") for site in fired["on_train_batch_end"])


def test_the_scan_flags_computed_and_misspelt_hook_names():
    code = """
bus.fire("on_fit_end")
for fn in self._bus.on_train_batch_end:
    fn(outputs, batch, batch_idx)
bus.fire(f"on_{stage}_end")
self._bus.fire_safely(hook, exc)
getattr(trainer._bus, f"on_{stage}_batch_start")
bus.fire("on_fit_ends")
for fn in self._bus.on_train_batch_ends:
    fn(outputs, batch, batch_idx)
trainer._bus.callbacks.append(cb)
"""
    fired, wrong = _scan({"x.py": code})
    assert fired == {"on_fit_end": ["x.py:2"], "on_train_batch_end": ["x.py:3"]}
    assert [site.split(":")[1] for site in wrong] == ["5", "6", "7", "8", "9"]


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
