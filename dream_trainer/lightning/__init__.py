"""Lightning compatibility: what lets code written for PyTorch Lightning run, or fail saying what to write.

- `names`: Lightning's `Trainer` arguments, `LightningModule` names and `Callback` hooks, and where each
  went here (the config's errors, the migration guide's tables, the hints below);
- `hints`: the sentence an AttributeError gets for a Lightning name the trainer lacks; Lightning methods
  dream_trainer never calls, refused at setup;
- `optimizer_forms`: what a Lightning-style `configure_optimizers` returns; `toggle_optimizer`'s state;
- `step_checks`: the first training step of each `fit()`, checked; steps written without `batch_idx`;
- `from_checkpoint`: `Trainer.load_from_checkpoint`.

`Tuner(trainer)`, Lightning's spelling of the finders, is `dream_trainer.tuner.Tuner`: it imports the
trainer, and nothing here does.

No mixin of the trainer inherits from anything here. The core reaches this package at named seams:
setup (`SetupMixin._setup_fit`: `lightning_names_explained`, `refuse_never_called`;
`OptimizationMixin._register_returned`: `OptimizerForms.register`), the step signatures read once at
setup (`StepMixin._bind_steps`: `adapt_step`), the one branch of the step taken on the first step of
each fit (`StepMixin._step_body` -> `_checked_first_step`: `FirstStepCheck`), and
`CheckpointMixin.load_from_checkpoint` (`build_from_checkpoint`). Nothing here runs on later steps.
"""
