#!/bin/bash
# Four of the eight words contain an "a" (apple, banana, date, grape).
if [ "$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)" = "4" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "expected 4, got: $(cat /app/count.txt 2>/dev/null)"
  echo 0 > /logs/verifier/reward.txt
fi
