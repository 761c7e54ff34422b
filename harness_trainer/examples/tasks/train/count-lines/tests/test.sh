#!/bin/bash
# Verifier: /app/count.txt holds the line count of words.txt (12), whitespace ignored.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
if [ -f /app/count.txt ] && [ "$(tr -d '[:space:]' < /app/count.txt)" = "12" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
