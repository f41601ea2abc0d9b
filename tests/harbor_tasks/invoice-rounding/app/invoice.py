"""Invoice totals in cents."""


def line_total(amount_cents: int, quantity: int) -> int:
    return amount_cents * quantity


def invoice_total(lines, discount_percent: float) -> int:
    """The total of ``lines`` ((amount_cents, quantity) pairs) after the discount."""
    total = 0.0
    for amount, quantity in lines:
        total += line_total(amount, quantity) * (100 - discount_percent) / 100
    return int(total)
