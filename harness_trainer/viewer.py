"""A static trace viewer: one self-contained HTML file of a run's last steps, token by token.

:func:`build_viewer` reads ``run_dir/rollouts.jsonl`` (and ``metrics.jsonl``, ``eval.jsonl`` and
``eval_rollouts.jsonl`` when there are) and writes one HTML file with inline CSS and JS, no network and no
server: the evaluations (per evaluation its step, policy version, pass@1 and pass@k, a table of its tasks
and, when ``eval_rollouts.jsonl`` has them, each task's samples with their reward or unscorable reason and
their traces, shown as a training rollout's), a metrics table per shown step, then each step's groups and
rollouts (task, reward, advantage, verifier reward, why it did not train, timeout, unscorable reason, tool
calls, failures, timings and their split into model calls, environment and other, policy versions,
findings), then the rollouts no step took (errored ones included, with their reasons), and each rollout's
turns with every token coloured by its role:

    trained    a completion token with loss mask 1 (rows.py trains each of them exactly once)
    context    a prompt token: input only
    auxiliary  a completion token of a turn whose completion is all mask 0 (title generation, side calls)
    discarded  a completion token with mask 0 in a turn that has trained tokens

Each rollout shows its ``rollout_id`` and ``capture_session_id`` and, with its trace, the
``harness-trainer proxy-trace DATA_DIR/sessions/ID`` command that exports its trace again from its capture
journal (``DATA_DIR`` is the capture proxy's data folder: ``capture_dir``, by default ``RUN_DIR/capture``
when the run has one, as the dev loop's runs do; else the command says ``DATA_DIR``). A journal exists
while the proxy keeps its session: a rollout deletes its capture session when it ends.

A turn's prompt starts with what an earlier turn already showed (its parent's full sequence, or a
sibling's prompt); that shared part is not repeated, so each rollout's tokens appear about once. Hovering a
token shows its id and its behaviour logprob. Turns are collapsed; only the last ``max_steps_shown`` steps
are included, and traces only until ``max_tokens_shown`` tokens are on the page (newest step first, then the
evaluations' samples, newest evaluation first), so a long run gives a file of bounded size.

Importing this module loads no pydantic, jinja, transformers or torch (the CLI builds its parser with
:func:`add_view_arguments`); they are imported when a viewer is built.

Everything from the run is untrusted text (task names, findings, token text): it is escaped, and the page
carries a Content-Security-Policy that allows only its own inline script, as a second wall.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import math
import os
import shlex
import sys
from collections import Counter
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_trainer.trainer.reporting import METRICS_FILE

if TYPE_CHECKING:
    from harness_trainer.trace import TrainingTrace, TrainingTurn
    from harness_trainer.trainer.feed.rollout_log import RolloutRecord

VIEWER_FILE = "viewer.html"
EVAL_FILE = "eval.jsonl"
"""Written by the trainer's evaluations: one line per (evaluation, task)."""
TEMPLATE = "viewer_template.html.jinja"
ROLES = ("trained", "context", "auxiliary", "discarded")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
STEP_METRICS = (
    "reward", "reward_std", "rewards/env_reward", "loss", "kl", "entropy", "clip_ratio", "grad_norm",
    "completions/mean_length", "tools/call_frequency", "tools/failure_frequency", "rollout/unscorable",
    "rollout/timed_out_frac", "rollout/dropped_groups", "staleness/mean", "perf/step_s",
    "perf/rollout_llm_s", "perf/rollout_env_s", "perf/rollout_other_s",
)  # fmt: skip
"""Metrics of ``metrics.jsonl`` shown in the per-step table, when logged."""
_SCRIPT = (  # marks the page as scripted (CSS shows the buttons then), and wires the buttons
    "document.body.classList.add('js');"
    "for (const [id, open] of [['expand', true], ['collapse', false]]) {"
    "document.getElementById(id).addEventListener('click', () => {"
    "for (const d of document.querySelectorAll('details.turn, details.trace')) d.open = open; }); }"
)


@dataclass
class TurnView:
    index: int
    node_id: str
    tokens: str
    """The turn's shown tokens as HTML spans, escaped here."""
    roles: Counter[str]
    shared: int
    """Leading prompt tokens not shown again: the same as in turn ``shared_with``."""
    shared_with: int | None
    finish_reason: str | None


@dataclass
class RolloutView:
    record: RolloutRecord
    turns: list[TurnView] = field(default_factory=list)
    """Empty when the trace is left out (the page's token budget was spent) or there is none."""
    roles: Counter[str] = field(default_factory=Counter)
    rows: int = 0
    turn_count: int = 0
    completion_tokens: int = 0
    left_out: bool = False
    journal: str | None = None
    """The command that exports the rollout's trace from its capture journal; None without a capture id."""


@dataclass
class GroupView:
    index: int
    task_name: str | None
    task_index: int | None
    rollouts: list[RolloutView]


@dataclass
class StepView:
    step: int | None
    """None: the rollouts no step took."""
    metrics: dict[str, Any] | None
    groups: list[GroupView]


@dataclass
class EvalView:
    """One evaluation: the ``eval.jsonl`` lines of one step and split, one per task, and the samples of
    ``eval_rollouts.jsonl`` by task (``task_name``, ``task_index``)."""

    step: int
    policy_version: Any
    split: Any
    k: Any
    temperature: Any
    tasks: list[dict[str, Any]]
    samples: dict[tuple[Any, Any], list[RolloutView]] = field(default_factory=dict)

    def samples_of(self, task: dict[str, Any]) -> list[RolloutView]:
        """The samples of one of :attr:`tasks`; [] when none were recorded (a run before
        ``eval_rollouts.jsonl``)."""
        return self.samples.get((task.get("task_name"), task.get("task_index")), [])

    @property
    def pass_at_1(self) -> float | None:
        return _mean_of(self.tasks, "pass@1")

    @property
    def pass_at_k(self) -> float | None:
        return _mean_of(self.tasks, "pass@k")

    @property
    def reward(self) -> float | None:
        """The mean reward over every scored sample of every task."""
        rewards = [r for task in self.tasks for r in task.get("rewards") or [] if _is_number(r)]
        return sum(rewards) / len(rewards) if rewards else None

    @property
    def unscorable(self) -> int:
        return sum(1 for task in self.tasks for reason in task.get("unscorable") or [] if reason is not None)


def build_viewer(
    run_dir: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str] | None,
    out: str | os.PathLike[str] | None = None,
    max_steps_shown: int = 20,
    max_tokens_shown: int = 1_000_000,
    capture_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the viewer of ``run_dir`` (default ``run_dir/viewer.html``) and return its path.

    ``capture_dir`` is the capture proxy's data folder, named in each rollout's ``proxy-trace`` command
    (default: :func:`default_capture_dir`; without one the command says ``DATA_DIR``).

    ``tokenizer_dir`` decodes each token on its own (``transformers.AutoTokenizer``); without one, a token
    shows as ``⟨id⟩``. Traces are rendered newest step first, then the evaluations' samples newest first,
    until ``max_tokens_shown`` tokens are on the page (about 40 bytes each); the rest are left out with a
    note, their rollouts still in the tables.

    Raises:
        FileNotFoundError: the run has no ``rollouts.jsonl``.
        ValueError: ``max_steps_shown`` < 1 or ``max_tokens_shown`` < 0, or a malformed line in the run's
            files (named by file and line).
        OSError: the tokenizer cannot be loaded.
    """
    from harness_trainer.plots import read_metrics
    from harness_trainer.trainer.feed.evaluation import read_eval_rollouts
    from harness_trainer.trainer.feed.rollout_log import ROLLOUTS_FILE, read_rollout_log

    if max_steps_shown < 1 or max_tokens_shown < 0:
        raise ValueError(
            f"max_steps_shown must be at least 1 and max_tokens_shown at least 0, got {max_steps_shown} and "
            f"{max_tokens_shown}"
        )
    run = Path(run_dir)
    if not (run / ROLLOUTS_FILE).is_file():
        raise FileNotFoundError(f"{run} has no {ROLLOUTS_FILE}: it is written by a training run")
    records = read_rollout_log(run, last_steps=max_steps_shown, validate_traces=False)
    metrics = {line["step"]: line for line in read_metrics(run)} if (run / METRICS_FILE).is_file() else {}
    evaluations = read_evaluations(run / EVAL_FILE) if (run / EVAL_FILE).is_file() else []
    capture = capture_dir if capture_dir is not None else default_capture_dir(run)
    text = _TokenText(tokenizer_dir)
    steps = _steps(records, metrics, text, max_tokens_shown, capture)
    totals: Counter[str] = Counter()
    for step in steps:
        for group in step.groups:
            for rollout in group.rollouts:
                totals.update(rollout.roles)
    samples = read_eval_rollouts(run, validate_traces=False) if evaluations else []
    _attach_samples(evaluations, samples, text, max_tokens_shown - totals.total(), capture)
    page = _template().render(
        run_name=run.resolve().name,
        steps=steps,
        evaluations=evaluations,
        metric_names=[n for n in STEP_METRICS if any(s.metrics and n in s.metrics for s in steps)],
        totals=totals,
        roles=ROLES,
        tokenizer=str(tokenizer_dir) if tokenizer_dir is not None else None,
        capture_dir=str(capture) if capture is not None else None,
        max_steps_shown=max_steps_shown,
        max_tokens_shown=max_tokens_shown,
        script=_SCRIPT,
        script_hash=base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode(),
    )
    target = Path(out) if out is not None else run / VIEWER_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target


def _steps(
    records: list[RolloutRecord],
    metrics: dict[int, dict[str, Any]],
    text: _TokenText,
    budget: int,
    capture_dir: str | os.PathLike[str] | None,
) -> list[StepView]:
    """Newest step first, then the rollouts no step took (step None); groups and members in the order they
    were logged; traces rendered while the token ``budget`` lasts."""
    by_step: dict[int | None, dict[int, GroupView]] = {}
    # Stable: the logged order within a step. The untaken last: the reader sees what trained first.
    for record in sorted(records, key=lambda r: (r.step is None, -(r.step or 0))):
        groups = by_step.setdefault(record.step, {})
        group = groups.get(record.group)
        if group is None:
            group = groups[record.group] = GroupView(record.group, record.task_name, record.task_index, [])
        view = _view(record, text if budget > 0 else None, capture_dir)
        budget -= view.roles.total()
        group.rollouts.append(view)
    return [
        StepView(step, metrics.get(step) if step is not None else None, list(groups.values()))
        for step, groups in by_step.items()
    ]


def _attach_samples(
    evaluations: list[EvalView],
    records: list[RolloutRecord],
    text: _TokenText,
    budget: int,
    capture_dir: str | os.PathLike[str] | None,
) -> None:
    """Each eval sample under its task in the evaluation of its step, in the order written; traces
    rendered while the token ``budget`` lasts, newest evaluation first.

    Samples are kept on the latest timeline, as the evaluations are: a step evaluated again (a resumed run,
    or ``harness-trainer eval`` into the same folder) keeps its last samples, under the last evaluation of
    that step that has their task.
    """
    from harness_trainer.trainer.feed.rollout_log import latest_steps

    kept = latest_steps((r.step, (r.group, r.member), r) for r in records if r.step is not None)
    by_task: dict[tuple[int, Any, Any], list[RolloutRecord]] = {}
    for step, step_records in kept.items():
        for record in step_records:
            by_task.setdefault((step, record.task_name, record.task_index), []).append(record)
    owners: dict[tuple[int, Any, Any], EvalView] = {}
    for evaluation in evaluations:  # the later of a step's evaluations wins; the key keeps its first place
        for task in evaluation.tasks:
            owners[(evaluation.step, task.get("task_name"), task.get("task_index"))] = evaluation
    for key, evaluation in owners.items():  # newest evaluation first, as ``evaluations`` are
        if key not in by_task:
            continue
        views = evaluation.samples[key[1:]] = []
        for record in by_task[key]:
            view = _view(record, text if budget > 0 else None, capture_dir)
            budget -= view.roles.total()
            views.append(view)


def read_evaluations(path: str | os.PathLike[str]) -> list[EvalView]:
    """The evaluations of an ``eval.jsonl``, newest step first: its lines grouped by step and split in the
    order written, on the latest timeline (a resumed run that evaluates a step again supersedes it, as in
    ``metrics.jsonl``).

    Raises:
        ValueError: a line is not a JSON object, or has no integer ``step``.
    """
    from harness_trainer.trainer.feed.rollout_log import latest_steps, read_jsonl

    def entries() -> Iterator[tuple[int, Hashable, dict[str, Any]]]:
        for number, _, line in read_jsonl(path):
            step = line.get("step")
            if type(step) is not int:
                raise ValueError(f"{path}:{number}: an evaluation line needs an integer step")
            yield step, (line.get("split"), line.get("task_name"), line.get("task_index")), line

    evaluations: list[EvalView] = []
    for step, lines in reversed(latest_steps(entries()).items()):
        by_split: dict[Any, EvalView] = {}
        for line in lines:
            split = line.get("split")
            if split not in by_split:
                by_split[split] = EvalView(
                    step, line.get("policy_version"), split, line.get("k"), line.get("temperature"), []
                )
            by_split[split].tasks.append(line)
        evaluations.extend(by_split.values())
    return evaluations


def _mean_of(lines: list[dict[str, Any]], key: str) -> float | None:
    values = [line[key] for line in lines if _is_number(line.get(key))]
    return sum(values) / len(values) if values else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def journal_command(capture_session_id: str, capture_dir: str | os.PathLike[str] | None) -> str:
    """``harness-trainer proxy-trace …`` for a capture session's journal, quoted for a POSIX shell;
    ``DATA_DIR`` stands for the capture proxy's data folder when ``capture_dir`` is None."""
    if capture_dir is None:
        return f"harness-trainer proxy-trace DATA_DIR/sessions/{shlex.quote(capture_session_id)}"
    journal = Path(capture_dir) / "sessions" / capture_session_id
    return f"harness-trainer proxy-trace {shlex.quote(str(journal))}"


def _view(
    record: RolloutRecord, text: _TokenText | None, capture_dir: str | os.PathLike[str] | None
) -> RolloutView:
    """:func:`_rollout`, with the command that exports its trace from its capture journal."""
    view = _rollout(record, text)
    if record.capture_session_id is not None:
        view.journal = journal_command(record.capture_session_id, capture_dir)
    return view


def _rollout(record: RolloutRecord, text: _TokenText | None) -> RolloutView:
    """The rollout's view, its turns rendered unless ``text`` is None (the budget is spent)."""
    from harness_trainer.trainer.step.rows import build_rows

    view = RolloutView(record)
    trace = record.trace
    if trace is None:
        return view
    view.turn_count = len(trace.turns)
    view.completion_tokens = sum(len(turn.completion_token_ids) for turn in trace.turns)
    if text is None:
        view.left_out = True
        return view
    view.rows = len(build_rows(trace))
    for index, turn in enumerate(trace.turns):
        shared_with, shared = _shared_prefix(trace, index)
        tokens, roles = _tokens(turn, shared, text)
        finish = (((turn.response.get("choices") or [{}])[0]) or {}).get("finish_reason")
        view.turns.append(TurnView(index, turn.node_id, tokens, roles, shared, shared_with, finish))
        view.roles.update(roles)
    return view


def _shared_prefix(trace: TrainingTrace, index: int) -> tuple[int | None, int]:
    """The longest start of turn ``index``'s prompt already shown by an earlier turn: that turn's full
    sequence (its parent, found first in an append-only history) or its prompt (a sibling)."""
    prompt = trace.turns[index].prompt_token_ids
    best: tuple[int | None, int] = (None, 0)
    for earlier in range(index - 1, -1, -1):
        other = trace.turns[earlier]
        start = len(other.prompt_token_ids)
        end = start + len(other.completion_token_ids)
        if start > len(prompt) or prompt[:start] != other.prompt_token_ids:
            continue
        if end <= len(prompt) and prompt[start:end] == other.completion_token_ids:
            if end > best[1]:
                best = (earlier, end)
            if earlier == index - 1:  # the previous call is the parent: the usual case, nothing longer
                break
        elif start > best[1]:
            best = (earlier, start)
    return best


def _tokens(turn: TrainingTurn, shared: int, text: _TokenText) -> tuple[str, Counter[str]]:
    prompt, completion = turn.prompt_token_ids, turn.completion_token_ids
    mask = turn.loss_mask[len(prompt) :]
    auxiliary = bool(completion) and not any(mask)
    roles: Counter[str] = Counter(context=len(prompt) - shared)
    parts = [f'<span class="context" title="id {token}">{text[token]}</span>' for token in prompt[shared:]]
    for token, logp, bit in zip(completion, turn.per_token_logps, mask, strict=True):
        role = "auxiliary" if auxiliary else "trained" if bit else "discarded"
        roles[role] += 1
        parts.append(f'<span class="{role}" title="id {token}, logp {logp:.4f}">{text[token]}</span>')
    return "".join(parts), roles


class _TokenText(dict[int, str]):
    """Escaped display text of each token id, decoded alone on first use, newlines marked; ``⟨id⟩`` without
    a tokenizer or for an id it cannot decode."""

    def __init__(self, tokenizer_dir: str | os.PathLike[str] | None) -> None:
        super().__init__()
        self._tokenizer: Any = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def __missing__(self, token: int) -> str:
        piece = ""
        if self._tokenizer is not None:
            try:
                piece = self._tokenizer.decode([token])
            # Slow tokenizers raise on an id past their vocabulary, fast ones give "": both show the id.
            except (IndexError, KeyError, ValueError, OverflowError):
                piece = ""
        text = html.escape(piece).replace("\n", "↵\n") if piece else f"⟨{token}⟩"
        self[token] = text
        return text


def _number(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:.4g}"


def _finding(value: dict[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def _template() -> Any:
    import jinja2

    source = resources.files("harness_trainer").joinpath(TEMPLATE).read_text(encoding="utf-8")
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    environment.filters.update(num=_number, finding=_finding)
    return environment.from_string(source)


def default_tokenizer_dir(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest ``checkpoint-*/model`` of the run that holds tokenizer files, or None."""
    from harness_trainer.trainer.checkpoint import CHECKPOINT_PREFIX, MODEL_DIR  # imports torch: only here

    candidates = []
    for path in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*/{MODEL_DIR}"):
        step = path.parent.name.removeprefix(CHECKPOINT_PREFIX)
        if step.isdigit() and any((path / name).is_file() for name in TOKENIZER_FILES):
            candidates.append((int(step), path))
    return max(candidates)[1] if candidates else None


def default_capture_dir(run_dir: str | os.PathLike[str]) -> Path | None:
    """``run_dir/capture`` when it holds capture sessions (the dev loop's runs keep their journals there)."""
    capture = Path(run_dir) / "capture"
    return capture if (capture / "sessions").is_dir() else None


def add_view_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``harness-trainer view RUN_DIR [--tokenizer DIR] [-o FILE] [--steps N]
    [--max-tokens N] [--capture-dir DIR]``."""
    parser.add_argument("run_dir", type=Path, help="a training run's output folder (holds rollouts.jsonl)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer folder to decode tokens (default: the run's newest checkpoint-*/model with tokenizer "
        "files; without one, tokens show as ⟨id⟩)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, default=None, help=f"HTML file to write (default: RUN_DIR/{VIEWER_FILE})"
    )
    parser.add_argument("--steps", type=int, default=20, help="how many of the last steps to include")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1_000_000,
        help="tokens rendered at most, newest steps first; later traces are left out (about 40 bytes each)",
    )
    parser.add_argument(
        "--capture-dir",
        type=Path,
        default=None,
        help="the capture proxy's data folder (its --data-dir), named in each rollout's proxy-trace command "
        "(default: RUN_DIR/capture when it holds sessions/, as the dev loop's runs do; else DATA_DIR)",
    )


def run_view(args: argparse.Namespace) -> int:
    """``harness-trainer view``: print the HTML file's path; 2 with a message when the run cannot be read."""
    tokenizer = args.tokenizer if args.tokenizer is not None else default_tokenizer_dir(args.run_dir)
    try:
        path = build_viewer(
            args.run_dir,
            tokenizer_dir=tokenizer,
            out=args.output,
            max_steps_shown=args.steps,
            max_tokens_shown=args.max_tokens,
            capture_dir=args.capture_dir,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
