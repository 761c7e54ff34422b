"""Per-region sales totals from the ledger files in /app/data/."""

import csv
import json
from pathlib import Path

DATA = Path("/app/data")


def totals() -> dict[str, int]:
    result: dict[str, int] = {}
    for ledger in sorted(DATA.glob("*.csv")):
        with ledger.open(newline="") as handle:
            for row in csv.DictReader(handle):
                cents = int(float(row["amount"]))  # amounts are in dollars with cents
                result[row["region"]] = cents
    return result


def main() -> None:
    rows = [{"region": region, "total_cents": cents} for region, cents in sorted(totals().items())]
    Path("/app/report.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
