#!/bin/bash
set -euo pipefail
psql -h db -U postgres -At -c \
  "select customer from orders group by customer order by sum(total_cents) desc limit 1" > /app/top_customer.txt
