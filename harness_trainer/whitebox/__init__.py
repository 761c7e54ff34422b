"""White-box rollouts (issue 23): the trainer owns sampling, an OpenEnv harness adapter owns the loop.

- :mod:`~harness_trainer.whitebox.model_step`: :class:`TokenModelStep`, OpenEnv's ``ModelStep`` over an
  engine's ``/v1/completions`` by token ids, and :class:`AnswersParseErrors`, the session wrapper that
  hands a malformed tool call back to the model as an error.
- :mod:`~harness_trainer.whitebox.episode`: the recorded turns as a validated ``TrainingTrace`` (pure).
- :mod:`~harness_trainer.trainer.feed.whitebox`: a ``ResourceSessionFactory`` and an adapter as the session
  factory the trainer's scheduler drives (the trainer's ``harness_adapter=``).
- :mod:`~harness_trainer.whitebox.react`: :class:`ReActAdapter`, the built-in adapter for coding tasks (a
  ReAct loop over the session's tools, ending on ``submit``).

Importing :mod:`~harness_trainer.whitebox.model_step`, :mod:`~harness_trainer.trainer.feed.whitebox` or
:mod:`~harness_trainer.whitebox.react` needs the ``openenv`` and ``trl`` extras.
"""
