"""``harness-trainer eval``: the training run's evaluation, standalone, on a saved checkpoint.

``--checkpoint DIR`` is a run's ``checkpoint-{step}`` folder (its ``model/``, and its
``trainer_state.json`` for the step and weight version recorded with the results) or a folder
``save_model`` wrote. A LoRA adapter is merged into its base first (the adapter config names it); a
folder without a tokenizer takes the one of the model the run trained (recorded in the checkpoint), or
``--tokenizer``. The folder is served by the dev engine or a real vLLM (``--engine``), and ``--split`` of
the ``--tasks`` folder is rolled out ``-k`` times per task by the real agent in local sandboxes through the
capture proxy: the same :class:`~harness_trainer.trainer.feed.evaluation.Evaluator`, seeds and scoring as
evaluation during training (with several harnesses, ``--harness a,b``, each task is rolled out ``-k``
times under each). It prints one line per task (and harness) and the means (each harness's, then all),
and appends the records to ``OUTPUT_DIR/eval.jsonl`` and each sample, its trace included, to
``OUTPUT_DIR/eval_rollouts.jsonl``. Everything it starts is stopped on every path; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_trainer.devloop.run import ENGINE_CHOICES, EXAMPLE_TASKS, RUN_DEFAULTS, RUN_EXCLUDED, RUN_FIXED
from harness_trainer.devloop.solver import SCRIPTED_HARNESSES
from harness_trainer.engines.kinds import kind_of
from harness_trainer.launch.config_file import add_run_arguments, run_options_from

if TYPE_CHECKING:
    from harness_trainer.trainer.feed.evaluation import EvalRecord

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json")
"""A model folder's own files besides its weights: never taken from the tokenizer's folder."""


class CheckpointError(ValueError):
    """The checkpoint folder cannot be served: what is missing, and how to give it."""


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``harness-trainer eval``'s flags."""
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a run's checkpoint-N folder, or a folder save_model wrote")  # fmt: skip
    add_run_arguments(
        parser,
        defaults={**RUN_DEFAULTS, "split": "test"},
        exclude=(*RUN_EXCLUDED, "mode"),  # the real agent's evaluation: black-box
        choices={"harness": SCRIPTED_HARNESSES},
    )
    parser.add_argument("-k", "--num-generations", dest="k", type=int, default=1,
                        help="rollouts per task (k of pass@k)")  # fmt: skip
    parser.add_argument("--tasks", type=Path, default=EXAMPLE_TASKS, help="a folder of Harbor tasks")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--pass-reward", type=float, default=1.0, help="a sample passes at this reward")
    parser.add_argument("--max-concurrent-rollouts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (eval seeds follow from it)")
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default="dev")
    parser.add_argument("--vllm-python", type=Path, default=None)
    parser.add_argument(
        "--tokenizer", type=Path, default=None,
        help="a folder with the tokenizer, when the checkpoint has none and names no model",
    )  # fmt: skip
    parser.add_argument(
        "--output-dir", type=Path, default=None,
        help="where eval.jsonl, eval_rollouts.jsonl and the engine log go (default: eval-<checkpoint name>)",
    )  # fmt: skip


def checkpoint_model(checkpoint: Path) -> tuple[Path, dict[str, Any]]:
    """The model folder of ``checkpoint`` and its trainer state (``{}`` for a ``save_model`` folder).

    Raises:
        CheckpointError: no model in it.
    """
    from harness_trainer.trainer.checkpoint import MODEL_DIR, STATE_FILE  # torch: not at --help time

    state_file = checkpoint / STATE_FILE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    folder = checkpoint / MODEL_DIR if (checkpoint / MODEL_DIR).is_dir() else checkpoint
    if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise CheckpointError(
            f"no model in {checkpoint}: give a checkpoint-N folder of a run or a folder save_model wrote"
        )
    return folder, state


def servable_folder(model: Path, trained_from: str | None, tokenizer: Path | None, into: Path) -> Path:
    """A folder an engine can serve: ``model``'s weights (a LoRA adapter merged into its base) and a
    tokenizer (``model``'s own, else ``tokenizer``'s, else the trained model's folder ``trained_from``).

    Raises:
        CheckpointError: no tokenizer to be found, or an adapter whose base is not a local folder.
    """
    into.mkdir(parents=True, exist_ok=True)
    if (model / "adapter_config.json").is_file():
        base = json.loads((model / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise CheckpointError(f"the adapter in {model} names base model {base!r}: not a folder here")
        _merge_adapter(Path(base), model, into)
        trained_from = trained_from or base
    else:
        for file in model.iterdir():
            if file.is_file():
                (into / file.name).symlink_to(file.resolve())
    if _has_tokenizer(into):
        return into
    source = tokenizer or (Path(trained_from) if trained_from else None)
    if source is None or not _has_tokenizer(source):
        raise CheckpointError(
            f"{model} has no tokenizer, nor has a model folder the checkpoint names: pass --tokenizer"
        )
    for file in source.iterdir():
        keep = file.is_file() and file.name not in MODEL_FILES and file.suffix not in WEIGHT_SUFFIXES
        if keep and not (into / file.name).exists():
            shutil.copy2(file, into / file.name)
    return into


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file()


def _merge_adapter(base: Path, adapter: Path, into: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(into)


def run_eval(args: argparse.Namespace) -> int:
    """The ``harness-trainer eval`` command."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_eval(args)
    except KeyboardInterrupt:
        print("eval: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run_eval(args: argparse.Namespace) -> int:
    import threading

    from harness_trainer import LocalSessionFactory
    from harness_trainer.devloop.engine import start_local_engine
    from harness_trainer.engines.vllm_process import check_vllm_python, vllm_python
    from harness_trainer.tasks.sources import LocalTaskSource
    from harness_trainer.trainer.feed.evaluation import Evaluator

    run = run_options_from(args, **RUN_FIXED)
    if args.k < 1:
        raise ValueError(f"-k must be at least 1, got {args.k}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be ≥ 0, got {args.temperature}")
    python = args.vllm_python or vllm_python()
    if kind_of(args.engine).own_python and (problem := check_vllm_python(python)) is not None:
        raise ValueError(problem)
    source = LocalTaskSource(args.tasks)
    if run.split not in source.splits():
        known = ", ".join(source.splits()) or "none"
        raise ValueError(f"no split {run.split!r} in {args.tasks} (it has {known})")
    rows = source.prompt_rows(run.split)
    model, state = checkpoint_model(args.checkpoint)
    step, version = int(state.get("step", 0)), int(state.get("policy_version", 0))
    output = args.output_dir or Path(f"eval-{args.checkpoint.resolve().name}")
    output.mkdir(parents=True, exist_ok=True)
    sampling: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_completion_length}
    with tempfile.TemporaryDirectory(prefix="ht-eval-") as work:
        trained_from = state.get("extra", {}).get("model")
        served = servable_folder(model, trained_from, args.tokenizer, Path(work) / "model")
        vocab = json.loads((served / "config.json").read_text()).get("vocab_size")
        with (output / "engine.log").open("ab") as log:
            engine = start_local_engine(args.engine, served, seed=args.seed, output=log, vllm_python=python)
        try:
            factory = LocalSessionFactory(
                source, upstream=engine.url, split=run.split, harness=run.harness, sampling=sampling,
                agent_step_limit=run.agent_step_limit, agent_timeout_sec=run.agent_timeout_sec,
                data_dir=output / "capture",
            )  # fmt: skip
            try:
                evaluator = Evaluator(
                    factory, rows, k=args.k, seed=args.seed, temperature=args.temperature,
                    pass_reward=args.pass_reward, max_concurrent_rollouts=args.max_concurrent_rollouts,
                    rollout_timeout=run.rollout_wait_s, vocab_size=vocab, reward_fn=None, output_dir=output,
                    split=run.split,
                )  # fmt: skip
                evaluated = evaluator.evaluate(step, version, threading.Event())
            finally:
                factory.close()
        finally:
            engine.stop()
    assert evaluated is not None  # nothing sets the stop event: Ctrl-C raises instead
    _report(evaluator.path, *evaluated, args.k)
    return 0


def _report(path: Path, metrics: dict[str, float], records: list[EvalRecord], k: int) -> None:
    """One line per task (per task and harness, in a mix), each harness's means, then the means over all."""
    from harness_trainer.trainer.feed.evaluation import HARNESS_PREFIX, harness_names

    for record in records:
        rewards = ", ".join("-" if r is None else f"{r:g}" for r in record.rewards)
        task = record.task_name if record.harness is None else f"{record.task_name} under {record.harness}"
        print(f"{task}: pass@1 {_fmt(record.pass_at_1)}, pass@{k} {_fmt(record.pass_at_k)} "
              f"(rewards {rewards})")  # fmt: skip
    for name in harness_names(metrics):
        print(f"{name}: {_means(metrics, f'{HARNESS_PREFIX}{name}/', k)}")
    print(
        f"mean over {int(metrics['eval/tasks'])} tasks: {_means(metrics, 'eval/', k)}, "
        f"{metrics['eval/wall_s']:.0f} s; records in {path}"
    )


def _means(metrics: dict[str, float], prefix: str, k: int) -> str:
    return (
        f"pass@1 {metrics[prefix + 'pass@1']:.3f}, pass@{k} {metrics[prefix + 'pass@k']:.3f}, reward "
        f"{metrics[prefix + 'reward']:.3f}, {int(metrics[prefix + 'unscorable'])} unscorable"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
