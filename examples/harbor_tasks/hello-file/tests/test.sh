#!/bin/bash
# Runs from the working directory after the agent; writes the reward the Harbor way.
if [ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, Harbor!" ]; then
  echo "hello.txt is right"
  echo 1 > /logs/verifier/reward.txt
else
  echo "hello.txt is missing or wrong"
  echo 0 > /logs/verifier/reward.txt
fi
