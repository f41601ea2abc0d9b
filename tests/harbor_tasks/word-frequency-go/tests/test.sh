#!/bin/bash

cd /app
cp /tests/wordfreq_test.go /app/
go test ./...

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
