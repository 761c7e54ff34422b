#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
wc -l < /app/data/words.txt | tr -d ' ' > /app/count.txt
