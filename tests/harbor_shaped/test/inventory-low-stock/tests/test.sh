#!/bin/bash
cd /app || exit 1
python3 -m pytest -q /tests/test_outputs.py > /logs/verifier/pytest.log 2>&1
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
