"""The trace viewer: a run folder written by RolloutLog becomes one static HTML file, checked as text and as
rendered by a real headless Chromium.

Chromium is found on PATH (``chromium``, ``chromium-browser``, ``google-chrome``); without it the rendering
tests skip, unless ``HT_REQUIRE_CHROMIUM=1`` (CI), where they fail.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness_trainer.rollouts.client.session import VerifyResult
from harness_trainer.trace import TrainingTrace, load_trace
from harness_trainer.trainer.feed.rollout_log import RolloutLog
from harness_trainer.trainer.feed.rollout_records import rollout_record
from harness_trainer.trainer.reporting import MetricsReporter
from harness_trainer.trainer.step.groups import Rollout
from harness_trainer.trainer.step.outcome import build_outcome
from harness_trainer.trainer.step.rows import build_rows
from harness_trainer.viewer.command import add_view_arguments, default_tokenizer_dir, run_view
from harness_trainer.viewer.page import VIEWER_FILE, build_viewer
from tests.trainer.handmade import chain_trace

ATTACK = "<script>document.body.dataset.pwned='1'</script>"
EVIL_TASK = f"fix-{ATTACK}"
EVIL_FINDING = {"message": "</li><img src=x onerror=\"document.body.dataset.pwned='1'\">"}
EVIL_REASON = "RolloutUnscorable: <b onmouseover=\"document.body.dataset.pwned='1'\">sandbox</b> gone"
STEPS = (1, 2, 3)


def rich_trace(tokenizer) -> tuple[TrainingTrace, dict[str, int]]:
    """An agent turn, a title-generation turn (all mask 0) and a follow-up turn with a partial mask; with
    the role counts the viewer should show (the follow-up's prompt repeats turn 0, which is not shown)."""
    prompt = tokenizer.encode(
        f"<|im_start|>user\n{ATTACK} Fix the failing test<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = tokenizer.encode("I will run the tests first.<|im_end|>")
    title_prompt = tokenizer.encode("<|im_start|>system\nGenerate a short title<|im_end|>\n")
    title = tokenizer.encode("Fixing tests<|im_end|>")
    tool = tokenizer.encode("\n<|im_start|>tool\n2 failed<|im_end|>\n")
    edit = tokenizer.encode("Now edit the file.<|im_end|>")
    follow = prompt + answer + tool
    turns = [
        turn("a", prompt, answer, [1] * len(answer)),
        turn("title", title_prompt, title, [0] * len(title)),
        turn("b", follow, edit, [1, 1, 1] + [0] * (len(edit) - 3)),
    ]
    roles = {
        "trained": len(answer) + 3,
        "context": len(prompt) + len(title_prompt) + len(tool),
        "auxiliary": len(title),
        "discarded": len(edit) - 3,
    }
    return load_trace({"turns": turns}), roles


def turn(node_id: str, prompt: list[int], completion: list[int], mask: list[int]) -> dict:
    return {
        "node_id": node_id, "prompt_token_ids": prompt, "completion_token_ids": completion,
        "per_token_logps": [-0.25] * len(completion), "loss_mask": [0] * len(prompt) + mask,
        "response": {"choices": [{"finish_reason": "stop"}]},
    }  # fmt: skip


def rollout(group: int, member: int, trace: TrainingTrace, step: int) -> Rollout:
    verify = VerifyResult(env_reward=0.75 * member, metrics={"phase_seconds": {"agent": 5.0}})
    return Rollout(
        group, member, policy_version=step - 1, reward=0.75 * member, trace=trace, rows=build_rows(trace),
        outcome=build_outcome(trace, verify, timed_out=member == 2), timed_out=member == 2, seconds=6.5,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, dict[str, int]]:
    """Three steps; per step a group of 3 with the rich trace first, a group of 2 chain traces, and an
    unscorable rollout; the role counts expected for one step."""
    from transformers import AutoTokenizer

    run_dir = tmp_path_factory.mktemp("run")
    trace, expected = rich_trace(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    expected = dict(expected)
    with MetricsReporter(run_dir, "none") as reporter, RolloutLog(run_dir) as log:
        for step in STEPS:
            records = []
            for group, members in ((0, 3), (1, 2)):
                for member in range(members):
                    used = trace if (group, member) == (0, 0) else load_trace(chain_trace(group, member))
                    records.append(rollout_record(
                        rollout(group, member, used, step), step=step,
                        task_name=EVIL_TASK if group == 0 else "parse-config", task_index=group,
                        advantage=None if member == 2 else member - 0.5, verify_metrics=None,
                        findings=[EVIL_FINDING, "test_parse failed"] if member == 0 else None,
                    ))  # fmt: skip
            unscorable = Rollout(2, 0, unscorable=EVIL_REASON)
            records.append(rollout_record(
                unscorable, step=step, task_name="lint", task_index=2, advantage=None, verify_metrics=None,
                findings=None,
            ))  # fmt: skip
            log.write(records)
            reporter.log({"reward": 0.375, "reward_std": 0.5, "loss": 0.125 * step}, step)
    # Four chain traces per step: each shows 6 trained tokens and 3 + 1 context ones (turn 1 repeats turn 0).
    expected["trained"] += 4 * 6
    expected["context"] += 4 * 4
    return run_dir, expected


def spans(page: str, role: str) -> int:
    return page.count(f'<span class="{role}" title="id ')


def test_every_token_is_shown_once_with_its_role(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path
) -> None:
    run_dir, expected = run
    page = build_viewer(run_dir, tokenizer_dir=tiny_model_dir).read_text()
    for role, count in expected.items():
        assert spans(page, role) == len(STEPS) * count, role
        assert f'<span class="{role}">{role}</span> {len(STEPS) * count}' in page  # the legend's total
    assert "⋯ 3 tokens as in turn 0 ⋯" not in page and "⋯ 6 tokens as in turn 0 ⋯" in page
    assert '<span class="trained" title="id ' in page and ", logp -0.2500" in page


def test_trained_tokens_are_those_the_rows_train(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    trace, roles = rich_trace(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    assert sum(row.n_targets for row in build_rows(trace)) == roles["trained"]


def test_only_the_last_steps_are_included(run: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    run_dir, _ = run
    page = build_viewer(run_dir, tokenizer_dir=None, out=tmp_path / "v.html", max_steps_shown=2).read_text()
    assert 'id="step-3"' in page and 'id="step-2"' in page and 'id="step-1"' not in page
    assert page.index('id="step-3"') < page.index('id="step-2"')  # newest first, and only it open
    assert '<details class="step" id="step-3" open>' in page and '<details class="step" id="step-2">' in page
    assert page.count('<details class="turn">') == 2 * (3 + 4 * 2)  # every turn collapsed


def test_traces_past_the_token_budget_are_left_out_newest_step_first(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    page = build_viewer(run[0], tokenizer_dir=None, out=tmp_path / "v.html", max_tokens_shown=1).read_text()
    assert page.count('<details class="turn">') == 3  # the first rollout of step 3, the rich trace
    assert page.count("(trace left out: the page already shows 1 tokens") == len(STEPS) * 5 - 1
    assert page.count("(no trace captured)") == len(STEPS)  # the unscorable rollouts have none to leave out
    assert page.count("<td>0.75</td>") == len(STEPS) * 2 * 2  # member 1s reward, env reward: in the tables


def test_untrusted_text_is_escaped(run: tuple[Path, dict[str, int]], tiny_model_dir: Path) -> None:
    run_dir, _ = run
    page = build_viewer(run_dir, tokenizer_dir=tiny_model_dir).read_text()
    assert page.count("<script") == 1  # the viewer's own
    assert "<img" not in page and "<b " not in page
    assert "task fix-&lt;script&gt;document.body.dataset.pwned=&#39;1&#39;&lt;/script&gt;" in page
    assert "&lt;b onmouseover=&#34;document.body.dataset.pwned=&#39;1&#39;&#34;&gt;sandbox" in page
    assert "onerror=\\&#34;document.body" in page  # the finding, as its JSON text


def test_without_a_tokenizer_tokens_show_as_their_ids(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    page = build_viewer(run[0], tokenizer_dir=None, out=tmp_path / "ids.html").read_text()
    assert '<span class="context" title="id 13">⟨13⟩</span>' in page
    assert "shown as ⟨id⟩ (no tokenizer)" in page


def journal_commands(page: str) -> list[str]:
    """The proxy-trace commands on the page, as a reader copies them."""
    return [html.unescape(c) for c in re.findall(r'<p class="journal">journal: <code>(.*?)</code>', page)]


def test_each_rollout_shows_its_ids_and_the_command_that_opens_its_capture_journal(tmp_path: Path) -> None:
    scored = rollout(0, 1, load_trace(chain_trace(0, 1)), 1)
    scored.capture_session_id = "cs_scored-Id_1"
    unscorable = Rollout(0, 2, unscorable="RolloutUnscorable: sandbox died", capture_session_id="cs_gone")
    never_minted = Rollout(0, 3, unscorable="RolloutUnscorable: the capture proxy is unreachable")
    hostile = Rollout(0, 4, unscorable="odd", capture_session_id="x; touch /tmp/pwned")
    with RolloutLog(tmp_path) as log:
        log.write(
            rollout_record(r, step=1, task_name="t", task_index=0, advantage=None, verify_metrics=None,
                           findings=None)
            for r in (scored, unscorable, never_minted, hostile)
        )  # fmt: skip

    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    assert '<td class="text ids"><span>group0-member1</span><br>cs_scored-Id_1</td>' in page
    assert '<td class="text ids"><span>group0-member2</span><br>cs_gone</td>' in page
    assert '<td class="text ids"><span>group0-member3</span><br>no capture session</td>' in page
    assert journal_commands(page) == [  # unscorable ones too; none for the rollout without a session
        "harness-trainer proxy-trace DATA_DIR/sessions/cs_scored-Id_1",
        "harness-trainer proxy-trace DATA_DIR/sessions/cs_gone",
        "harness-trainer proxy-trace DATA_DIR/sessions/'x; touch /tmp/pwned'",  # quoted for the shell
    ]

    (tmp_path / "capture" / "sessions").mkdir(parents=True)  # where the dev loop keeps its journals
    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    journals = tmp_path / "capture" / "sessions"
    assert journal_commands(page)[1] == f"harness-trainer proxy-trace {journals / 'cs_gone'}"
    elsewhere = tmp_path / "proxy data"
    page = build_viewer(tmp_path, tokenizer_dir=None, capture_dir=elsewhere).read_text()
    assert journal_commands(page)[1] == f"harness-trainer proxy-trace '{elsewhere / 'sessions' / 'cs_gone'}'"


def test_the_view_command_takes_the_capture_proxys_data_folder(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.write([
            rollout_record(Rollout(0, 0, unscorable="gone", capture_session_id="cs_a"), step=1,
                           task_name="t", task_index=0, advantage=None, verify_metrics=None, findings=None)
        ])  # fmt: skip
    assert run_view(view_args(str(tmp_path), "--capture-dir", "/srv/capture")) == 0
    page = (tmp_path / VIEWER_FILE).read_text()
    assert journal_commands(page) == ["harness-trainer proxy-trace /srv/capture/sessions/cs_a"]


def test_a_folder_without_rollouts_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no rollouts\.jsonl"):
        build_viewer(tmp_path, tokenizer_dir=None)
    for limits in ({"max_steps_shown": 0}, {"max_tokens_shown": -1}):
        with pytest.raises(ValueError, match="max_steps_shown must be at least 1"):
            build_viewer(tmp_path, tokenizer_dir=None, **limits)


# -- the view command --------------------------------------------------------------------------------------


def view_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="harness-trainer view")
    add_view_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_cli_can_import_the_view_and_plot_commands_without_heavy_libraries() -> None:
    code = (
        "import sys, harness_trainer.viewer.command, harness_trainer.plots; "
        "print(sorted({'pydantic', 'jinja2', 'transformers', 'torch', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_view_command_writes_the_file_and_prints_its_path(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out" / "page.html"
    assert (
        run_view(view_args(str(run[0]), "--tokenizer", str(tiny_model_dir), "-o", str(out), "--steps", "1"))
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert 'id="step-3"' in page and 'id="step-2"' not in page and "⟨13⟩" not in page


def test_the_view_command_decodes_with_the_newest_checkpoint_that_has_a_tokenizer(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    for step, with_tokenizer in ((1, True), (2, True), (3, False)):
        model = run_dir / f"checkpoint-{step}" / "model"
        model.mkdir(parents=True)
        if with_tokenizer:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny_model_dir / name, model / name)
    assert default_tokenizer_dir(run_dir) == run_dir / "checkpoint-2" / "model"
    assert default_tokenizer_dir(tmp_path / "elsewhere") is None
    assert run_view(view_args(str(run_dir))) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / VIEWER_FILE)
    page = (run_dir / VIEWER_FILE).read_text()
    assert "⟨13⟩" not in page and str(run_dir / "checkpoint-2" / "model") in page


def test_the_view_command_reports_a_bad_run_and_exits_2(tmp_path: Path, capsys) -> None:
    assert run_view(view_args(str(tmp_path))) == 2
    assert "has no rollouts.jsonl" in capsys.readouterr().err


# -- rendered by a real browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if found is None:
        reason = "chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("HT_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"HT_REQUIRE_CHROMIUM=1 but {reason}")
        pytest.skip(reason)
    return found


def browse(chromium: str, page: Path, profile: Path, *flags: str) -> str:
    command = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--hide-scrollbars", f"--user-data-dir={profile}", *flags, page.resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_chromium_renders_the_page_with_the_run_in_it(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path, chromium: str, tmp_path: Path
) -> None:
    page = build_viewer(run[0], tokenizer_dir=tiny_model_dir, out=tmp_path / "viewer.html")
    dom = browse(chromium, page, tmp_path / "profile", "--dump-dom")
    assert '<body class="js">' in dom  # the page's own script ran under its Content-Security-Policy
    assert "data-pwned" not in dom
    text = html.unescape(re.sub(r"<[^>]+>", "", dom))
    assert EVIL_TASK in text and "task parse-config" in text and "lint" in text  # task names, as text
    assert "<td>0.75</td>" in dom and "<td>0.375</td>" in dom  # a reward, the step's mean reward
    assert "I will run the tests first.<|im_end|>" in text and "Fix the failing test" in text  # tokens

    shot = tmp_path / "shot.png"
    browse(chromium, page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1200, 900)
    assert len(data) > 20_000
    try:
        from PIL import Image
    except ImportError:  # the header and size checks above are what we can do without Pillow
        return
    with Image.open(shot) as image:
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert len(colours) > 50  # text, tables, the legend: not a blank page
    assert {
        (0xBF, 0xEA, 0xC4),
        (0xD9, 0xD2, 0xF6),
        (0xF8, 0xCA, 0xCA),
    } <= colours  # the legend's role colours


def test_escaping_alone_keeps_the_attack_inert(
    run: tuple[Path, dict[str, int]], tiny_model_dir: Path, chromium: str, tmp_path: Path
) -> None:
    page = build_viewer(run[0], tokenizer_dir=tiny_model_dir, out=tmp_path / "viewer.html")
    no_policy = tmp_path / "no-csp.html"
    no_policy.write_text(re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text()))
    assert "Content-Security-Policy" not in no_policy.read_text()
    expanded = no_policy.read_text().replace("<details ", "<details open ")
    no_policy.write_text(expanded)
    dom = browse(chromium, no_policy, tmp_path / "profile", "--dump-dom")
    assert '<body class="js">' in dom and "data-pwned" not in dom


# -- the run's full record and its evaluations ---------------------------------------------------------------


def test_rollouts_that_never_trained_show_with_their_reasons_and_the_untaken_last(tmp_path: Path) -> None:
    from harness_trainer.trainer.feed.rollout_records import FEW_SCORED, UNSCORABLE, RolloutOutcome, RunStart

    trained = rollout(0, 1, load_trace(chain_trace(0, 1)), 1)
    trained.seconds = 6.5
    for i, turn in enumerate(trained.trace.turns):
        turn.metadata.update(
            started_at=100.0 + i, finished_at=101.0 + i, dispatch_version=3, weight_version=4
        )
    lonely = rollout(1, 0, load_trace(chain_trace(1, 0)), 1)
    failed = Rollout(1, 1, unscorable="RolloutUnscorable: sandbox 7 would not start")
    stopped = Rollout(2, 0, unscorable="RuntimeError: training stopped")

    def done(r: Rollout, with_trace: bool = True):
        return rollout_record(r, task_name=f"t{r.group}", task_index=r.group, verify_metrics=r.verify_metrics,
                              findings=None, with_trace=with_trace)  # fmt: skip

    with RolloutLog(tmp_path) as log:
        log.write([RunStart(step=0, start_group=0)])
        log.write([done(trained), done(lonely, with_trace=False), done(failed), done(stopped)])
        log.write([
            RolloutOutcome(step=1, group=0, member=1, advantage=0.5),
            RolloutOutcome(step=1, group=1, member=0, not_trained=FEW_SCORED),
            RolloutOutcome(step=1, group=1, member=1, not_trained=UNSCORABLE),
        ])  # fmt: skip
    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    step, untaken = page.index('id="step-1"'), page.index('id="step-untaken"')
    assert step < untaken and "<h2>not taken by a step</h2>" in page
    assert f'<span class="badge">{html.escape(FEW_SCORED)}</span>' in page[step:untaken]
    assert "unscorable: RolloutUnscorable: sandbox 7 would not start" in page[step:untaken]
    assert "unscorable: RuntimeError: training stopped" in page[untaken:]
    assert "not taken by a step: the run ended first" in page[untaken:]
    assert "(trace not logged: rollout_log_steps)" in page
    # The time split and the versions the calls were sent and answered at.
    assert '<td class="text">2 · 0 · 4.5</td>' in page
    assert "0 · sent 3 · answered 4</td>" in page


def test_evaluations_show_each_with_its_step_version_pass_rates_and_tasks(tmp_path: Path) -> None:
    import json

    with RolloutLog(tmp_path):
        pass

    def line(step: int, version: int, name: str, index: int, rewards: list, unscorable: list) -> str:
        passed = sum(1 for r in rewards if r == 1.0)
        return json.dumps({
            "step": step, "policy_version": version, "split": "test", "task_name": name, "task_index": index,
            "k": len(rewards), "temperature": 1.0, "rewards": rewards, "unscorable": unscorable,
            "passed": passed, "pass@1": passed / len(rewards), "pass@k": float(passed > 0),
        })  # fmt: skip

    lines = [
        line(0, 0, "hello-file", 0, [0.0, 1.0], [None, None]),
        line(0, 0, f"evil-{ATTACK}", 1, [0.0, None], [None, "SandboxStartError: <b>no</b> sandbox"]),
        line(4, 4, "hello-file", 0, [1.0, 1.0], [None, None]),
        line(4, 4, f"evil-{ATTACK}", 1, [1.0, 0.0], [None, None]),
    ]
    (tmp_path / "eval.jsonl").write_text("\n".join(lines) + "\n")
    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    assert "<h3>Evaluations</h3>" in page and ATTACK not in page
    summary = page[page.index("<h3>Evaluations</h3>") : page.index('<details class="eval"')]
    rows = re.findall(r"<tr><td><a href=\"#eval-\d\">(\d+)</a></td><td>(\S+)</td>", summary)
    assert rows == [("4", "4"), ("0", "0")]  # newest first
    assert "<td>0.75</td><td>1</td><td>0.75</td><td>0</td>" in summary  # step 4: pass@1, pass@k, reward
    assert "<td>0.25</td><td>0.5</td><td>0.3333</td><td>1</td>" in summary  # step 0: one unscorable sample
    assert "SandboxStartError: &lt;b&gt;no&lt;/b&gt; sandbox" in page
    assert "<td>1 / 2</td>" in page and "hello-file (#0)" in page
    # A run from before eval_rollouts.jsonl: the tables alone, as before.
    assert '<details class="samples">' not in page and "samples and their traces" not in page

    (tmp_path / "eval.jsonl").write_text('{"step": "late"}\n')
    with pytest.raises(ValueError, match=r"eval\.jsonl:1: an evaluation line needs an integer step"):
        build_viewer(tmp_path, tokenizer_dir=None)


def test_each_evaluated_task_shows_its_samples_and_their_traces_under_its_evaluation(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import json

    from transformers import AutoTokenizer

    from harness_trainer.trainer.feed.evaluation import EVAL_ROLLOUTS_FILE

    with RolloutLog(tmp_path):
        pass
    rich, _ = rich_trace(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    tasks = {"hello-file": 0, f"evil-{ATTACK}": 1}

    def line(step: int, name: str, rewards: list, unscorable: list) -> str:
        return json.dumps({
            "step": step, "policy_version": step, "split": "test", "task_name": name,
            "task_index": tasks[name], "k": 2, "temperature": 1.0, "rewards": rewards,
            "unscorable": unscorable, "passed": 0, "pass@1": 0.0, "pass@k": 0.0,
        })  # fmt: skip

    def sample(step: int, name: str, member: int, trace: TrainingTrace | None, reason: str | None = None):
        done = Rollout(
            tasks[name], member, reward=None if reason else 0.5 * member, trace=trace, unscorable=reason,
            capture_session_id=f"cs-{step}-{tasks[name]}-{member}", policy_version=step,
        )  # fmt: skip
        record = rollout_record(done, task_name=name, task_index=tasks[name], verify_metrics=None,
                                findings=None, step=step)  # fmt: skip
        return record.model_dump_json()

    (tmp_path / "eval.jsonl").write_text("\n".join([
        line(0, "hello-file", [0.0, 0.5], [None, None]),
        line(0, f"evil-{ATTACK}", [0.0, 0.5], [None, None]),
        line(4, "hello-file", [0.0, 0.5], [None, None]),
        line(4, f"evil-{ATTACK}", [0.0, None], [None, EVIL_REASON]),
    ]) + "\n")  # fmt: skip
    (tmp_path / EVAL_ROLLOUTS_FILE).write_text("\n".join([
        *(sample(0, name, m, load_trace(chain_trace(9, m))) for name in tasks for m in (0, 1)),
        sample(4, "hello-file", 0, rich),
        sample(4, "hello-file", 1, load_trace(chain_trace(0, 1))),
        sample(4, f"evil-{ATTACK}", 0, load_trace(chain_trace(1, 0))),
        sample(4, f"evil-{ATTACK}", 1, None, EVIL_REASON),
    ]) + "\n")  # fmt: skip
    page = build_viewer(tmp_path, tokenizer_dir=tiny_model_dir).read_text()
    newest, oldest = page.index('id="eval-1"'), page.index('id="eval-2"')
    step_4, step_0 = page[newest:oldest], page[oldest:]  # the run has no training steps: nothing after
    assert "evaluation at step 4" in step_4 and "evaluation at step 0" in step_0
    assert "samples of hello-file (#0) · 2 sample(s)" in step_4
    assert "samples of evil-&lt;script&gt;" in step_4 and ATTACK not in page and "<b " not in page
    # The sample's transcript, token by token, as a training rollout's: the rich trace's words are decoded.
    hello = step_4[step_4.index("samples of hello-file") : step_4.index("samples of evil")]
    assert "sample 0 · reward 0: 3 turn(s)" in hello and "sample 1 · reward 0.5: 2 turn(s)" in hello
    assert ">Fix</span>" in hello and "> edit</span>" in hello and "> tests</span>" in hello
    assert hello.count('<details class="turn">') == 3 + 2
    assert "harness-trainer proxy-trace DATA_DIR/sessions/cs-4-0-0" in hello
    evil = step_4[step_4.index("samples of evil") :]
    assert 'sample 1 · <span class="badge bad">unscorable: RolloutUnscorable: &lt;b onmouseover' in evil
    assert "(no trace captured)" in evil and evil.count('<details class="turn">') == 2
    # Every sample of the older evaluation is under it, and only there.
    assert step_0.count('<details class="trace">') == 4 and step_4.count('<details class="trace">') == 4

    # A resumed run evaluates step 4 again: its samples replace the earlier ones, as its lines do.
    with (tmp_path / "eval.jsonl").open("a") as handle:
        handle.write(line(4, "hello-file", [1.0, 1.0], [None, None]) + "\n")
    with (tmp_path / EVAL_ROLLOUTS_FILE).open("a") as handle:
        handle.write(sample(4, "hello-file", 0, load_trace(chain_trace(0, 7))) + "\n")
    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    step_4 = page[page.index('id="eval-1"') : page.index('id="eval-2"')]
    assert "samples of hello-file (#0) · 1 sample(s)" in step_4 and "samples of evil" not in step_4
    assert "⟨307⟩" in step_4 and "Fix" not in step_4
    assert "samples and their traces" in page


def test_an_evaluation_of_a_mix_shows_each_harnesses_pass_rates_tasks_and_samples(tmp_path: Path) -> None:
    import json

    from harness_trainer.trainer.feed.evaluation import EVAL_ROLLOUTS_FILE

    with RolloutLog(tmp_path):
        pass
    mix = {"toy": [1.0, 1.0], "mini-swe-agent": [0.0, 1.0]}

    def line(name: str, index: int, harness: str) -> str:
        rewards = mix[harness] if index == 0 else [0.0, 0.0]
        passed = int(sum(rewards))
        return json.dumps({
            "step": 2, "policy_version": 2, "split": "test", "task_name": name, "task_index": index,
            "harness": harness, "k": 2, "temperature": 1.0, "rewards": rewards, "unscorable": [None, None],
            "passed": passed, "pass@1": passed / 2, "pass@k": float(passed > 0),
        })  # fmt: skip

    def sample(group: int, member: int, harness: str) -> str:
        trace = load_trace(chain_trace(group, member))
        done = Rollout(group, member, reward=mix[harness][member], trace=trace,
                       capture_session_id=f"cs-{harness}-{member}", policy_version=2)  # fmt: skip
        record = rollout_record(done, task_name="hello-file", task_index=0, verify_metrics=None,
                                findings=None, harness=harness, step=2)  # fmt: skip
        return record.model_dump_json()

    # Group h × 2 + i: task i under the h-th harness; only hello-file's samples were kept.
    lines = [line(name, i, h) for h in mix for i, name in enumerate(("hello-file", "sum-numbers"))]
    (tmp_path / "eval.jsonl").write_text("\n".join(lines) + "\n")
    samples = [sample(group, m, h) for group, h in ((0, "toy"), (2, "mini-swe-agent")) for m in (0, 1)]
    (tmp_path / EVAL_ROLLOUTS_FILE).write_text("\n".join(samples) + "\n")
    page = build_viewer(tmp_path, tokenizer_dir=None).read_text()
    summary = page[page.index("<h3>Evaluations</h3>") : page.index('<details class="eval"')]
    assert "per harness: pass@1 · pass@k" in summary
    assert '<td class="text harnesses">toy 0.5 · 0.5<br>mini-swe-agent 0.25 · 0.5</td>' in summary
    assert '<td class="text">test</td><td>2</td>' in summary  # tasks, each under both harnesses
    assert "<td>0.375</td><td>0.5</td>" in summary  # over every (task, harness)
    evaluation = page[page.index('id="eval-1"') :]
    assert "· toy: pass@1 0.5 · mini-swe-agent: pass@1 0.25</summary>" in evaluation
    assert evaluation.count('<td class="text">toy</td>') == 2
    assert evaluation.count('<td class="text">mini-swe-agent</td>') == 2
    toy = evaluation[evaluation.index("samples of hello-file (#0) under toy · 2 sample(s)") :]
    toy = toy[: toy.index("samples of hello-file (#0) under mini")]
    assert "sample 0 · reward 1" in toy and "sample 1 · reward 1" in toy and "cs-toy-0" in toy
    assert "cs-mini-swe-agent" not in toy
    mini = evaluation[evaluation.index("samples of hello-file (#0) under mini-swe-agent · 2 sample(s)") :]
    assert "sample 0 · reward 0:" in mini and "cs-mini-swe-agent-1" in mini and "cs-toy" not in mini
