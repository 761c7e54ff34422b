"""Training runs on Hugging Face Jobs.

- :mod:`.submit`: ``harness-trainer jobs submit`` (``add_submit_arguments``, ``run_submit``) builds the job
  spec and submits it with ``huggingface_hub``.
- :mod:`.job_launcher`: what the job runs: vLLM, the rollout server and its capture proxy, a warm-up
  sandbox (:mod:`.warm`) and the trainer, as planned by :mod:`.plan` (pure) and supervised as one
  (:mod:`.process_supervisor`).
- :mod:`.gpus`: how a machine's GPUs are split between vLLM and the trainer (pure), and
  :mod:`.trainer_entry`, the trainer as a module that ``accelerate launch`` and ``torchrun`` run.

Nothing is imported here, so ``python -m harness_trainer.jobs.job_launcher`` runs its module once, and
none of these modules imports ``huggingface_hub`` or torch at import time (the CLI's ``--help`` stays
instant).
"""
