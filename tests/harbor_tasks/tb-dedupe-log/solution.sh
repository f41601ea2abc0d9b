#!/bin/bash
awk '!seen[$0]++' /app/events.log > /app/unique.log
