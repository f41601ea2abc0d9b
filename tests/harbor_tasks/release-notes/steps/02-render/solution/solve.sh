#!/bin/bash
{
  echo "## Features"
  jq -r '.feat[] | "- " + .' /app/groups.json
  echo
  echo "## Fixes"
  jq -r '.fix[] | "- " + .' /app/groups.json
} > /app/RELEASE.md
