"""The rollout side of the trainer: what feeds each step its finished groups.

:mod:`.scheduling` runs groups of sessions in the background and judges failed rollouts
(:mod:`.failures`); :mod:`.curriculum` picks the rows to roll out; :mod:`.concurrency` (pure) and
:mod:`.load_poller` (its I/O) size the rollouts in flight from the engine's load; :mod:`.evaluation` rolls out
the held-out tasks; :mod:`.rollout_log` writes every rollout down, as the records of :mod:`.rollout_records`;
:mod:`.whitebox` makes an OpenEnv harness adapter a session factory the scheduler drives (white-box mode).
"""
