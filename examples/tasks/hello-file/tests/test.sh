#!/bin/sh
# Harbor's contract: write the reward to /logs/verifier/reward.txt (or reward.json)
if [ "$(cat /app/hello.txt 2>/dev/null)" = hello ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
