"""Launchers of real runs: the commands that start them, and the logic behind the scripts in ``examples/``.

:mod:`.harbor_run` (``harness-trainer train``, ``examples/async_grpo_harbor/train.py``) parses the flags
and runs the trainer; :mod:`.preflight` checks the engine, the rollout server and the output directory
before anything is spent; :mod:`.rewards` holds the launcher's reward function; :mod:`.config_file` reads
``--config``. :mod:`.serve` is ``harness-trainer serve`` (the rollout server), :mod:`.e2b_commands` the
``harness-trainer e2b`` commands (:mod:`.e2b_smoke` their live smoke test); :mod:`.flag_types` the
argparse types they share.
"""
