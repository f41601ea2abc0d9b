#!/bin/bash
duration=$(ffprobe -v error -show_entries format=duration -of csv=p=0 /app/trimmed.wav 2>/dev/null)
rate=$(ffprobe -v error -show_entries stream=sample_rate -of csv=p=0 /app/trimmed.wav 2>/dev/null)
if python3 -c "import sys; sys.exit(0 if abs(float('${duration:-0}') - 3.0) < 0.05 else 1)" && [ "$rate" = 16000 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
