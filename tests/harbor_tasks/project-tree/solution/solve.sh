#!/bin/bash
set -euo pipefail
cd /app
tree -a --charset ascii --noreport project > layout.txt
