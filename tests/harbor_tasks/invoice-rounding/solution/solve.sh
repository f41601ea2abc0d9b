#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
from pathlib import Path

path = Path("/app/invoice.py")
text = path.read_text()
text = text.replace('''    total = 0.0
    for amount, quantity in lines:
        total += line_total(amount, quantity) * (100 - discount_percent) / 100
    return int(total)''', '''    total = 0
    for amount, quantity in lines:
        discounted = Decimal(line_total(amount, quantity)) * (100 - Decimal(str(discount_percent))) / 100
        total += int(discounted.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return total''')
text = text.replace('"""Invoice totals in cents."""\n', '"""Invoice totals in cents."""\n\nfrom decimal import ROUND_HALF_UP, Decimal\n')
path.write_text(text)
PY
