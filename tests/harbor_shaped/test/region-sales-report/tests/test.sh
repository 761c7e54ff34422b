#!/bin/bash
# Harbor-style verifier: run the checks, write the reward.
cd /app || exit 1
python -m pytest -q /tests/test_outputs.py > /logs/verifier/pytest.log 2>&1
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
