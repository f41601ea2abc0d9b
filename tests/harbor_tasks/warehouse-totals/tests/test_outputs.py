import csv
import json
from pathlib import Path

OUT = Path("/app/totals.json")


def expected():
    sums = {}
    with open("/app/inventory.csv", newline="") as f:
        for row in csv.DictReader(f):
            key = (row["warehouse"], row["sku"])
            sums[key] = sums.get(key, 0) + int(row["quantity"])
    out = {}
    for (warehouse, sku), n in sums.items():
        if n:
            out.setdefault(warehouse, {})[sku] = n
    return out


def test_output_exists():
    assert OUT.is_file(), "totals.json was not written"


def test_output_is_json_object():
    data = json.loads(OUT.read_text())
    assert isinstance(data, dict)


def test_net_quantities():
    assert json.loads(OUT.read_text()) == expected()


def test_zero_entries_left_out():
    data = json.loads(OUT.read_text())
    assert all(n != 0 for skus in data.values() for n in skus.values())
    assert all(skus for skus in data.values())
    assert "oslo" not in data and "Z-001" not in data.get("lyon", {})
