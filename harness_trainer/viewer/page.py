"""The viewer's page: :func:`build_viewer` reads a run's files, builds their view model (:mod:`.views`)
and renders it with ``template.html.jinja`` into one HTML file (the package docstring says what it shows).

The template escapes every value from the run (autoescape); the token spans come escaped from
:mod:`.views`. The page's one inline script is allowed by its hash in the Content-Security-Policy.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any

from harness_trainer.trainer.reporting import METRICS_FILE
from harness_trainer.viewer.views import ROLES, TokenText, attach_samples, read_evaluations, step_views

VIEWER_FILE = "viewer.html"
EVAL_FILE = "eval.jsonl"
"""Written by the trainer's evaluations: one line per (evaluation, task)."""
TEMPLATE = "template.html.jinja"
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
    text = TokenText(tokenizer_dir)
    steps = step_views(records, metrics, text, max_tokens_shown, capture)
    totals: Counter[str] = Counter()
    for step in steps:
        for group in step.groups:
            for rollout in group.rollouts:
                totals.update(rollout.roles)
    samples = read_eval_rollouts(run, validate_traces=False) if evaluations else []
    attach_samples(evaluations, samples, text, max_tokens_shown - totals.total(), capture)
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

    source = resources.files("harness_trainer.viewer").joinpath(TEMPLATE).read_text(encoding="utf-8")
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    environment.filters.update(num=_number, finding=_finding)
    return environment.from_string(source)


def default_capture_dir(run_dir: str | os.PathLike[str]) -> Path | None:
    """``run_dir/capture`` when it holds capture sessions (the dev loop's runs keep their journals there)."""
    capture = Path(run_dir) / "capture"
    return capture if (capture / "sessions").is_dir() else None
