"""A static trace viewer: one self-contained HTML file of a run's last steps, token by token.

:func:`.page.build_viewer` reads ``run_dir/rollouts.jsonl`` (and ``metrics.jsonl``, ``eval.jsonl`` and
``eval_rollouts.jsonl`` when there are) and writes one HTML file with inline CSS and JS, no network and no
server: the evaluations (per evaluation its step, policy version, pass@1 and pass@k, a table of its tasks
and, when ``eval_rollouts.jsonl`` has them, each task's samples with their reward or unscorable reason and
their traces, shown as a training rollout's; in a run that mixes harnesses, each harness's pass@1 and
pass@k, and each task's line and samples under each harness), a metrics table per shown step, then each
step's groups and rollouts (task, reward, advantage, verifier reward, why it did not train, timeout,
unscorable reason, tool calls, failures, timings and their split into model calls, environment and other,
policy versions, findings), then the rollouts no step took (errored ones included, with their reasons),
and each rollout's turns with every token coloured by its role:

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

Everything from the run is untrusted text (task names, findings, token text): it is escaped, and the page
carries a Content-Security-Policy that allows only its own inline script, as a second wall.

Modules: :mod:`.views` builds the view model from a run's records (steps, groups, rollouts, evaluations,
token spans); :mod:`.page` renders it into the page (``template.html.jinja``); :mod:`.command` is
``harness-trainer view``. Importing them loads no pydantic, jinja, transformers or torch (the CLI builds its
parser with :func:`.command.add_view_arguments`); they are imported when a viewer is built.
"""
