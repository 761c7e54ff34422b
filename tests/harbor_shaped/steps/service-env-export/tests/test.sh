#!/bin/bash
# Shared by both steps: each step's tests/ adds its own check_step.py beside common.py.
cd /app || exit 1
if python3 /tests/check_step.py > /logs/verifier/check.log 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
