#!/bin/bash
# Verifier: the .txt notes are now .md with the same contents; keep.log is untouched.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
if [ "$(cd /app/notes 2>/dev/null && ls | sort | tr '\n' ' ')" = "ideas.md keep.log monday.md tuesday.md " ] \
  && [ "$(cat /app/notes/monday.md)" = "standup at 9" ] \
  && [ "$(cat /app/notes/tuesday.md)" = "review the plan" ] \
  && [ "$(cat /app/notes/ideas.md)" = "a better name for the project" ] \
  && [ "$(cat /app/notes/keep.log)" = "do not rename me" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
