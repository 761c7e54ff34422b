#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/restock.txt 2>/dev/null)" = "$(printf 'B-7\nC-3\nE-2')" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
