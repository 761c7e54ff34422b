#!/bin/bash
# Verifier: /app/sum.txt holds the sum of numbers.txt (145), whitespace ignored.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
if [ -f /app/sum.txt ] && [ "$(tr -d '[:space:]' < /app/sum.txt)" = "145" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
