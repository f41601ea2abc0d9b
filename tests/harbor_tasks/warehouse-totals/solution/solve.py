"""Net stock per warehouse and SKU from a movements CSV."""

import collections
import csv
import json
import sys


def main(src: str, dst: str) -> None:
    totals = collections.defaultdict(collections.Counter)
    with open(src, newline="") as f:
        for row in csv.DictReader(f):
            totals[row["warehouse"]][row["sku"]] += int(row["quantity"])
    out = {}
    for warehouse, skus in sorted(totals.items()):
        kept = {sku: n for sku, n in sorted(skus.items()) if n != 0}
        if kept:
            out[warehouse] = kept
    with open(dst, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
