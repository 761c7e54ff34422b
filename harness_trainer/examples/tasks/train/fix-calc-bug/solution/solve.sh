#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
sed -i 's/total(values) \/ (len(values) + 1)/total(values) \/ len(values)/' /app/calc.py
