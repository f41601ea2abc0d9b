import pathlib
import sys

print(sum(1 for p in pathlib.Path(sys.argv[1]).rglob("*.log") for line in p.read_text().splitlines() if line.strip()))
