#!/bin/bash

expected=$(psql -h db -U postgres -At -c \
  "select customer from orders group by customer order by sum(total_cents) desc limit 1")
if [ -n "$expected" ] && [ "$(cat /app/top_customer.txt 2>/dev/null)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
