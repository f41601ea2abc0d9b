from pathlib import Path


def test_unique_lines_in_first_seen_order():
    lines = Path("/app/events.log").read_text().splitlines()
    expected = list(dict.fromkeys(lines))
    assert Path("/app/unique.log").read_text().splitlines() == expected
