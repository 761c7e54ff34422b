"""Grades /app/summary.json (the one artifact); writes reward.json with the reward and whether this sandbox
saw nothing else of the agent's (its scratch file stays behind)."""

import json
from pathlib import Path

EXPECTED = {"count": 4, "total_cents": 20296, "most_expensive": "HD-900"}

try:
    summary = json.loads(Path("/app/summary.json").read_text())
    reward = 1 if all(summary.get(key) == value for key, value in EXPECTED.items()) else 0
except (OSError, ValueError) as exc:
    print(f"no usable summary: {exc}")
    reward = 0
isolated = 0 if Path("/app/prices.csv").exists() or Path("/app/scratch.txt").exists() else 1
Path("/logs/verifier/reward.json").write_text(json.dumps({"reward": reward, "isolated": isolated}))
