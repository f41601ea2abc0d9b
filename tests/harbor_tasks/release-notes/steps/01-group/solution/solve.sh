#!/bin/bash
python3 - <<'PY'
import json
groups = {}
for line in open("/app/commits.txt"):
    kind, _, subject = line.strip().partition(": ")
    groups.setdefault(kind, []).append(subject)
json.dump(groups, open("/app/groups.json", "w"), indent=2)
PY
