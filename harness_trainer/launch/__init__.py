"""Launchers of real runs: the importable, tested logic behind the scripts in ``examples/``.

:mod:`.harbor_run` (``examples/async_grpo_harbor/train.py``) parses the flags and runs the trainer;
:mod:`.preflight` checks the engine, the rollout server and the output directory before anything is spent;
:mod:`.rewards` holds the launcher's reward function.
"""
