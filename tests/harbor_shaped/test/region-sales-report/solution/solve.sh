#!/bin/bash
set -e
cd /app
python - <<'PY'
from pathlib import Path
path = Path("/app/report.py")
text = path.read_text()
text = text.replace('cents = int(float(row["amount"]))  # amounts are in dollars with cents',
                    'cents = round(float(row["amount"]) * 100)  # amounts are in dollars with cents')
text = text.replace('result[row["region"]] = cents', 'result[row["region"]] = result.get(row["region"], 0) + cents')
text = text.replace('sorted(totals().items())', 'sorted(totals().items(), key=lambda item: -item[1])')
path.write_text(text)
PY
python /app/report.py
