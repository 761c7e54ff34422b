#!/bin/bash
cd /app && python3 - <<'PY'
import json
import urllib.request

skus = [line.strip() for line in open("skus.txt") if line.strip()]
low = []
for sku in skus:
    with urllib.request.urlopen(f"http://inventory-api:8080/stock/{sku}", timeout=10) as reply:
        if json.load(reply)["on_hand"] < 5:
            low.append(sku)
open("restock.txt", "w").write("\n".join(low) + "\n")
PY
