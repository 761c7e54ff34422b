#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
python3 -c 'print(sum(int(line) for line in open("/app/numbers.txt") if line.strip()))' > /app/sum.txt
