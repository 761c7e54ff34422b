"""MetricsReporter: the metrics.jsonl record, report_to parsing, and each tracker for real, offline."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness_trainer.trainer.reporting import METRICS_FILE, MetricsReporter, resolve_report_to


def strict_json(line: str) -> dict:
    def reject(constant: str):
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def test_every_log_is_one_flushed_json_line_with_non_finite_values_as_null(tmp_path):
    with MetricsReporter(tmp_path, "none") as reporter:
        reporter.log({"loss": 1.5, "reward": float("nan"), "kl": float("inf")}, step=1)
        reporter.log({"loss": np.float32(0.25), "tokens": torch.tensor(7), "groups": np.int64(3)}, step=2)
        lines = (tmp_path / METRICS_FILE).read_text().splitlines()  # before close: flushed per line

    first, second = (strict_json(line) for line in lines)
    assert first["step"] == 1 and first["loss"] == 1.5 and first["reward"] is None and first["kl"] is None
    assert second == {"step": 2, "time": second["time"], "loss": 0.25, "tokens": 7.0, "groups": 3}
    assert abs(second["time"] - first["time"]) < 60


def test_a_resumed_run_appends_to_the_same_file(tmp_path):
    for step in (1, 2):
        with MetricsReporter(tmp_path, None) as reporter:
            reporter.log({"loss": float(step)}, step=step)

    assert [strict_json(line)["step"] for line in (tmp_path / METRICS_FILE).open()] == [1, 2]


def test_log_rejects_reserved_names_and_non_numbers_and_logging_after_close(tmp_path):
    reporter = MetricsReporter(tmp_path, "none")
    with pytest.raises(ValueError, match="reserved"):
        reporter.log({"step": 1}, step=1)
    with pytest.raises(TypeError, match="not a number"):
        reporter.log({"note": "1.5"}, step=1)
    reporter.close()
    reporter.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        reporter.log({"loss": 1.0}, step=2)


@pytest.mark.parametrize(
    ("report_to", "expected"),
    [
        (None, []),
        ("none", []),
        (["none"], []),
        ("", []),
        ("tensorboard", ["tensorboard"]),
        ("wandb, trackio", ["wandb", "trackio"]),
        (["trackio", "tensorboard", "trackio"], ["trackio", "tensorboard"]),
        ("all", ["tensorboard", "wandb", "trackio"]),
    ],
)
def test_report_to_is_parsed_like_transformers(report_to, expected):
    assert resolve_report_to(report_to, installed=lambda package: True) == expected


def test_all_means_every_installed_tracker():
    assert resolve_report_to("all", installed=lambda package: package == "wandb") == ["wandb"]
    assert resolve_report_to("all", installed=lambda package: False) == []


def test_unknown_tracker_is_a_value_error_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown report_to \\['mlflow'\\]; valid: none, all, tensorboard"):
        resolve_report_to("tensorboard,mlflow")
    with pytest.raises(ValueError, match="stand alone"):
        resolve_report_to(["none", "wandb"])


def test_a_tracker_named_but_not_installed_is_an_import_error_with_the_fix():
    with pytest.raises(
        ImportError, match=r"pip install 'harness-trainer\[tracking\]' \(or pip install wandb\)"
    ):
        resolve_report_to("tensorboard,wandb", installed=lambda package: package == "tensorboard")


def test_tensorboard_event_file_holds_the_scalars_at_their_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsReporter(tmp_path, "tensorboard", run_name="tb-run", config={"lr": 0.1}) as reporter:
        reporter.log({"loss": 2.0, "reward": 0.5}, step=10)
        reporter.log({"loss": 1.0}, step=20)

    events = EventAccumulator(str(tmp_path / "runs" / "tb-run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(10, 2.0), (20, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(10, 0.5)]
    assert "config/text_summary" in events.Tags()["tensors"]


def test_run_name_defaults_to_the_output_folder_name(tmp_path):
    output_dir = tmp_path / "my-run"
    with MetricsReporter(output_dir, "tensorboard") as reporter:
        reporter.log({"loss": 1.0}, step=1)

    assert (output_dir / "runs" / "my-run").is_dir()


@pytest.mark.slow
def test_wandb_offline_run_records_history_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    output_dir = tmp_path / "out"

    with MetricsReporter(output_dir, "wandb", run_name="wb-run", config={"lr": 0.1}, project="p") as reporter:
        reporter.log({"loss": 2.0}, step=3)
        reporter.log({"loss": 1.0, "reward": 0.5}, step=4)

    (log_file,) = glob.glob(str(output_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb_records(Path(log_file))
    history = [
        {item.nested_key[0]: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"]) for h in history] == [(3, 2.0), (4, 1.0)]
    assert history[1]["reward"] == 0.5
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "wb-run" and run.project == "p"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["lr"] == 0.1


def read_wandb_records(path: Path) -> list:
    """Decode wandb's transaction log (leveldb log format: 32 KiB blocks of checksummed chunks).

    wandb 0.31 ships no reader for its offline ``.wandb`` file, so the test decodes it itself.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32 * 1024, 7
    assert data[:4] == b":W&B"
    records, chunks, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        chunks += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


TRACKIO_SCRIPT = """
import json, sys
from harness_trainer.trainer.reporting import MetricsReporter
from trackio.sqlite_storage import SQLiteStorage

output_dir, result = sys.argv[1:]
with MetricsReporter(output_dir, "trackio", run_name="tr-run", config={"lr": 0.1}, project="p") as reporter:
    reporter.log({"loss": 2.0}, step=3)
    reporter.log({"loss": 1.0, "reward": float("nan")}, step=4)
logs, config = SQLiteStorage.get_logs("p", "tr-run"), SQLiteStorage.get_run_config("p", "tr-run")
open(result, "w").write(json.dumps({"logs": logs, "config": config}))
"""


def test_trackio_logs_to_a_local_database_without_the_hub(tmp_path):
    pytest.importorskip("trackio")
    # trackio fixes its database folder from TRACKIO_DIR when first imported, so a fresh interpreter
    # keeps the test from writing into the user's cache.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "out"), str(tmp_path / "result.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    result = json.loads((tmp_path / "result.json").read_text())
    assert [(log["step"], log["loss"]) for log in result["logs"]] == [(3, 2.0), (4, 1.0)]
    assert math.isnan(result["logs"][1]["reward"])
    assert result["config"]["lr"] == 0.1
    assert list((tmp_path / "trackio").glob("p.db"))
