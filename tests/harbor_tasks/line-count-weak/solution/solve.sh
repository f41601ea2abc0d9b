#!/bin/bash
python3 /solution/count.py /app/logs > /app/count.txt
