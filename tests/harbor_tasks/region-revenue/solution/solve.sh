#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import configparser, csv, json

settings = configparser.ConfigParser()
settings.read("/opt/report/settings.ini")
report = settings["report"]
excluded = {r.strip() for r in report["exclude"].split(",") if r.strip()}
totals = {}
with open("/data/sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        if row["region"] not in excluded:
            totals[row["region"]] = totals.get(row["region"], 0) + int(row["amount_cents"])
out = {"currency": report["currency"], "regions": {k: round(v / 100, 2) for k, v in sorted(totals.items())}}
with open("/app/revenue.json", "w") as f:
    json.dump(out, f, indent=2)
PY
