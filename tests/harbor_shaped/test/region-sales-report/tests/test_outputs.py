import csv
import json
import subprocess
from decimal import Decimal
from pathlib import Path


def expected():
    totals = {}
    for ledger in sorted(Path("/app/data").glob("*.csv")):
        with ledger.open(newline="") as handle:
            for row in csv.DictReader(handle):
                cents = int(Decimal(row["amount"]) * 100)
                totals[row["region"]] = totals.get(row["region"], 0) + cents
    return sorted(
        ({"region": r, "total_cents": c} for r, c in totals.items()), key=lambda x: -x["total_cents"]
    )


def test_report_is_regenerated_correctly():
    Path("/app/report.json").unlink(missing_ok=True)
    subprocess.run(["python", "/app/report.py"], check=True, timeout=60)
    assert json.loads(Path("/app/report.json").read_text()) == expected()
