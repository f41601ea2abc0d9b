#!/bin/bash

cd /app
if ! command -v tree > /dev/null; then
  echo "tree is not installed"
  echo 0 > /logs/verifier/reward.txt
  exit 0
fi
if [ -f layout.txt ] && diff <(tree -a --charset ascii --noreport project) layout.txt; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
