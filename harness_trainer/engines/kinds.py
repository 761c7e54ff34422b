"""The engine kinds a run can name and the ways weights can reach an engine: plain names, torch-free.

The trainer's config (``engine``, ``weight_sync``) and the launchers read these; the engine clients that
act on them (:mod:`.vllm`, :mod:`.dev`, :mod:`.weight_sync`) sit beside this module, so config never
imports torch to check a value.
"""

from __future__ import annotations

ENGINE_KINDS = ("auto", "vllm", "dev", "none")
"""``auto``: told by asking the engine; ``none``: no engine to push weights to."""
WEIGHT_SYNCS = ("auto", "nccl", "file")
"""How weights reach vLLM: NCCL from the trainer's GPU, or a safetensors file on a shared disk."""
