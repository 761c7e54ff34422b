#!/bin/bash
mkdir -p /logs/verifier
python3 /tests/check_summary.py > /logs/verifier/check.log 2>&1
