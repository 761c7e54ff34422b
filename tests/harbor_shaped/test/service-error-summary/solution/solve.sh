#!/bin/bash
set -e
cd /app/logs
for log in *.log; do
    count=$(awk '$2 == "ERROR"' "$log" | wc -l)
    if [ "$count" -gt 0 ]; then echo "${log%.log} $count"; fi
done | sort -k2,2nr -k1,1 > /app/error_summary.txt
