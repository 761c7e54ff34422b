"""LoRA adapter-only weight sync: each policy version's adapter in its own folder, served under its own name.

With ``use_peft`` and ``lora_sync="adapter"`` the trainer never merges: after a step it saves the adapter
(``save_pretrained`` of the PEFT model writes the adapter alone: megabytes, not the model) into
``<dir>/adapter-v<version>``, vLLM loads it as ``<lora_name>-v<version>``
(:meth:`~harness_trainer.engines.vllm.VLLMEngine.push_adapter`), and the rollouts' capture proxy is told
to send every later call to that name and record that version on its turn (``factory.set_policy``).
The newest ``keep`` folders stay on disk, as the newest ``keep`` adapters stay loaded in vLLM
(``max_staleness + 1``: a rollout may still be finishing on an older one).
"""

from __future__ import annotations

import shutil
from collections import deque
from pathlib import Path
from typing import Any

from harness_trainer.engines.weight_sync import run_folder


class AdapterFolders:
    """The folders of the adapters vLLM may still serve, newest last; older ones are deleted.

    Args:
        directory: where the run's folder is made (default ``/dev/shm`` when writable, else the temp dir);
            vLLM must read it at the same path.
        keep: folders kept, the newest included.
    """

    def __init__(self, directory: str | Path | None = None, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.run_dir = run_folder(directory, "harness-trainer-adapters-")
        self.keep = keep
        self._served: deque[Path] = deque()

    def save(self, model: Any, version: int) -> Path:
        """Save ``model``'s adapter (a PEFT model) as version ``version``; returns its folder."""
        folder = self.run_dir / f"adapter-v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        model.save_pretrained(str(folder))
        return folder

    def served(self, folder: Path) -> None:
        """vLLM serves ``folder`` now: keep it, delete the folders past the newest ``keep``."""
        self._served.append(folder)
        while len(self._served) > self.keep:
            shutil.rmtree(self._served.popleft(), ignore_errors=True)

    def discard(self, folder: Path) -> None:
        """Delete a folder vLLM did not take."""
        if folder not in self._served:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Delete every folder (idempotent)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._served.clear()
