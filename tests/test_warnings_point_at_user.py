"""Warnings the trainer gives point at the user's line (the `fit()` or `load_checkpoint()` call), not at
dream_trainer's own code."""

from __future__ import annotations

import warnings

from conftest import TinyTrainer, quiet_config


def _caught(run) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if issubclass(w.category, UserWarning)]


def test_nothing_to_resume_points_at_the_fit_call(tmp_path):
    caught = _caught(lambda: TinyTrainer(quiet_config(tmp_path)).fit(ckpt_path="last"))
    (warning,) = [w for w in caught if "no valid checkpoint" in str(w.message)]
    assert warning.filename == __file__, warning.filename


class OtherTrainer(TinyTrainer):
    pass


def test_a_checkpoint_of_another_trainer_points_at_the_load_call(tmp_path):
    trainer = TinyTrainer(quiet_config(tmp_path / "a"))
    trainer.fit()
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    caught = _caught(lambda: OtherTrainer(quiet_config(tmp_path / "b")).load_checkpoint(path, strict=False))
    (warning,) = [w for w in caught if "differs from this trainer" in str(w.message)]
    assert warning.filename == __file__, warning.filename
