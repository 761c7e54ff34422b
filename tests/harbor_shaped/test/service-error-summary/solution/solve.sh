#!/bin/bash
set -e
cd /app/logs
# No command substitution: gemini-cli's shell tool refuses it, and every agent replays this script.
for log in *.log; do
    awk -v service="${log%.log}" '$2 == "ERROR" { n++ } END { if (n > 0) print service, n }' "$log"
done | sort -k2,2nr -k1,1 > /app/error_summary.txt
