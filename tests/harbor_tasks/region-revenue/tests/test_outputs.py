import csv
import json
from pathlib import Path

OUT = Path("/app/revenue.json")


def expected():
    totals = {}
    with open("/data/sales.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["region"] not in ("test", "internal"):
                totals[row["region"]] = totals.get(row["region"], 0) + int(row["amount_cents"])
    return {k: round(v / 100, 2) for k, v in totals.items()}


def test_the_image_data_is_where_the_image_put_it():
    assert Path("/data/sales.csv").is_file() and Path("/opt/report/settings.ini").is_file()


def test_currency():
    assert json.loads(OUT.read_text())["currency"] == "EUR"


def test_regions():
    regions = json.loads(OUT.read_text())["regions"]
    assert set(regions) == set(expected())
    for region, total in expected().items():
        assert abs(regions[region] - total) < 0.005, region
