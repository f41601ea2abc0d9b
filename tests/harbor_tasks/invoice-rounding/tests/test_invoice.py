import sys

sys.path.insert(0, "/app")

from invoice import invoice_total  # noqa: E402


def test_no_discount():
    assert invoice_total([(999, 3), (1, 1)], 0) == 2998


def test_each_line_is_rounded_half_up():
    assert invoice_total([(999, 3)], 15) == 2547  # 2547.45
    assert invoice_total([(250, 1), (250, 1)], 10) == 450
    assert invoice_total([(5, 1), (5, 1)], 50) == 6  # 2.5 + 2.5, each rounded up


def test_fractional_percent():
    assert invoice_total([(1000, 1)], 12.5) == 875
    assert invoice_total([(333, 1)], 33.3) == 222  # 222.111
