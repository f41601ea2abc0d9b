#!/bin/bash
set -euo pipefail
python3 /solution/solve.py /app/inventory.csv /app/totals.json
