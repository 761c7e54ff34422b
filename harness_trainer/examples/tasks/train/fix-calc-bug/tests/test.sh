#!/bin/bash
# Verifier: calc.mean is the arithmetic mean and calc.total still sums.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
read -r -d '' CHECK <<'PY'
import sys
sys.path.insert(0, "/app")
import calc
assert calc.mean([1, 2, 3, 4]) == 2.5
assert calc.mean([5]) == 5
assert calc.mean([-1, 1]) == 0
assert calc.total([1, 2, 3]) == 6
PY
if python3 -B -c "$CHECK"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
