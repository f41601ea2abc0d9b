#!/bin/bash
ffmpeg -y -ss 2 -i /app/take.wav -c:a pcm_s16le /app/trimmed.wav
