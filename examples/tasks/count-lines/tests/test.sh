#!/bin/sh
if [ "$(cat /app/count.txt 2>/dev/null)" = "$(wc -l < /tests/expected.txt)" ]; then
  echo '{"reward": 1.0}' > /logs/verifier/reward.json
else
  echo '{"reward": 0.0}' > /logs/verifier/reward.json
fi
