// Package wordfreq counts words.
package wordfreq

// WordCount is one word and how often it occurs.
type WordCount struct {
	Word  string
	Count int
}

// TopWords returns the n most frequent words of text.
func TopWords(text string, n int) []WordCount {
	return nil
}
