#!/bin/bash
set -euo pipefail
cat > /app/wordfreq.go <<'GO'
// Package wordfreq counts words.
package wordfreq

import (
	"sort"
	"strings"
	"unicode"
)

// WordCount is one word and how often it occurs.
type WordCount struct {
	Word  string
	Count int
}

// TopWords returns the n most frequent words of text.
func TopWords(text string, n int) []WordCount {
	counts := map[string]int{}
	for _, word := range strings.FieldsFunc(text, func(r rune) bool { return !unicode.IsLetter(r) }) {
		counts[strings.ToLower(word)]++
	}
	out := make([]WordCount, 0, len(counts))
	for word, count := range counts {
		out = append(out, WordCount{word, count})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Count != out[j].Count {
			return out[i].Count > out[j].Count
		}
		return out[i].Word < out[j].Word
	})
	if n <= 0 {
		return []WordCount{}
	}
	if n < len(out) {
		out = out[:n]
	}
	return out
}
GO
cd /app && go build ./...
