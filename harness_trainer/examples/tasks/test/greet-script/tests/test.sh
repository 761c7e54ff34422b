#!/bin/bash
# Verifier: greet.sh greets its argument, or the world without one.
# Writes 1 (solved) or 0 to /logs/verifier/reward.txt; never fails before writing it.
mkdir -p /logs/verifier
if [ -f /app/greet.sh ] && [ "$(bash /app/greet.sh Ada)" = "Hello, Ada!" ] \
  && [ "$(bash /app/greet.sh)" = "Hello, world!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
