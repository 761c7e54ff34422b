#!/bin/bash
cd /app && python3 - <<'PY'
import csv
import json

with open("prices.csv") as handle:
    rows = list(csv.DictReader(handle))
prices = {row["sku"]: int(row["price_cents"]) for row in rows}
summary = {"count": len(prices), "total_cents": sum(prices.values()), "most_expensive": max(prices, key=prices.get)}
with open("summary.json", "w") as out:
    json.dump(summary, out)
with open("scratch.txt", "w") as out:
    out.write("worked out in the agent's sandbox\n")
PY
