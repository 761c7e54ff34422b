"""The trainer launcher (``harness-trainer train``: :func:`harness_trainer.launch.harbor_run.main`) as a
module that runs.

    accelerate launch --num_processes 4 --use_fsdp ... -m harness_trainer.jobs.trainer_entry TRAINER_ARGS
    torchrun --nproc_per_node 4 -m harness_trainer.jobs.trainer_entry TRAINER_ARGS

Both launchers run a module by its ``__main__`` block, which the launcher's own module does not have.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # torch and the trainer load only when run, not when the package is imported
    from harness_trainer.launch.harbor_run import main

    sys.exit(main())
