#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
printf 'Hello, Harbor!\n' > /app/hello.txt
