"""Submit a training run to Hugging Face Jobs; the same options as ``harness-trainer jobs submit``.

python examples/jobs/submit.py --flavor h200x2 --dataset ORG/TASKS --dry-run -- --harness opencode --model ...
"""

from __future__ import annotations

import sys

from harness_trainer.jobs.submit import main

if __name__ == "__main__":
    sys.exit(main())
