#!/bin/bash
python3 - <<'PY' && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
import json
assert json.load(open("/app/groups.json")) == {
    "feat": ["add retry budget", "stream results"],
    "fix": ["close the socket on timeout", "off-by-one in paging"],
    "docs": ["describe the cache"],
}
PY
