#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import json, os

import jwt

claims = []
for line in open("/app/tokens.txt"):
    token = line.strip()
    if not token:
        continue
    try:
        claims.append(jwt.decode(token, os.environ["TOKEN_SECRET"], algorithms=["HS256"]))
    except jwt.InvalidSignatureError:
        continue
json.dump(claims, open("/app/claims.json", "w"), indent=2)
PY
