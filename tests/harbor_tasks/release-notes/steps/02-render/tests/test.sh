#!/bin/bash
expected=$'## Features\n- add retry budget\n- stream results\n\n## Fixes\n- close the socket on timeout\n- off-by-one in paging'
if [ "$(cat /app/RELEASE.md 2>/dev/null)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
