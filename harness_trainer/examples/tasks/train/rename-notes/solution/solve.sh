#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
for f in /app/notes/*.txt; do
  mv -- "$f" "${f%.txt}.md"
done
