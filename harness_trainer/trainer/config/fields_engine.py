"""The engine section of :class:`~.async_grpo.AsyncGRPOConfig`: the inference engine, its replicas, and
how weights reach them."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_trainer.engines.kinds import ENGINE_KINDS, WEIGHT_SYNCS
from harness_trainer.trainer.config.field_help import field_help


@dataclass
class EngineFields:
    """The engine and the weight sync."""

    # Engine and weight sync.
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000",
        metadata=field_help("The inference engine's URL (vLLM or the dev engine)."),
    )
    engine: str = field(
        default="auto",
        metadata=field_help(
            f"Engine kind, one of {ENGINE_KINDS}. 'auto': told by asking the engine at vllm_server_base_url "
            "when the trainer is made (the dev engine answers GET /weight_version, vLLM does not), so the "
            "same script runs against either; 'none' pushes no weights."
        ),
    )
    weight_sync_steps: int = field(default=1, metadata=field_help("Push weights every N steps."))
    weight_sync_retries: int = field(
        default=3, metadata=field_help("Attempts of a weight push before stopping.")
    )
    weight_sync_timeout: float = field(
        default=300.0, metadata=field_help("Seconds one weight push may take.")
    )
    weight_sync: str = field(
        default="auto",
        metadata=field_help(
            f"How weights reach vLLM, one of {WEIGHT_SYNCS}: 'nccl' (vLLM's NCCL weight transfer, trainer "
            "and vLLM on different GPUs or hosts), 'file' (a safetensors file in weight_sync_dir that "
            "vLLM reloads in place: CPU, one GPU), 'auto' ('file' for a vLLM on this host, else 'nccl')."
        ),
    )
    vllm_pause_mode: str = field(
        default="wait",
        metadata=field_help(
            "How a weight push pauses vLLM, by vLLM's names: 'wait' drains the generations in flight "
            "first (no turn mixes two versions; the engine idles while the longest finishes), 'keep' "
            "freezes them between two decode steps and goes on with them on the new weights after the "
            "push (the agents only wait; such a turn holds tokens of two versions, each trained against "
            "the logprob it was sampled with, and is stamped with the newer). 'keep' is for full-weight "
            "pushes: a LoRA run that publishes its adapter drains."
        ),
    )
    weight_sync_dir: str | None = field(
        default=None,
        metadata=field_help("Folder the 'file' path writes to, readable by vLLM (default: /dev/shm)."),
    )
    vllm_replica_urls: list[str] = field(
        default_factory=list,
        metadata=field_help(
            "Further replicas of the engine at vllm_server_base_url (same kind, same model; vLLM's data "
            "parallelism across servers): each weight push pauses, pushes to and resumes every one, and a "
            "replica that fails a push is out of rotation until a later push gives it the current weights "
            "(harness_trainer.engines.EngineReplicas). The rollouts' capture proxy routes over them "
            "(serve --upstream A --upstream B --replicas). A comma-separated string is split."
        ),
    )
    replica_proxy_url: str | None = field(
        default=None,
        metadata=field_help(
            "The capture proxy that routes the rollouts over vllm_replica_urls (serve --replicas's "
            "--capture-port, or python -m capture_proxy --replicas): a replica that goes out is drained "
            "there and enabled once current. Its admin key comes from $CAPTURE_PROXY_ADMIN_KEY (serve "
            "--capture-admin-key sets the one it starts with). None: a replica out is only recorded, and "
            "the proxy's sessions on it wait while it stays paused."
        ),
    )
