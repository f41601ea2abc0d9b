package wordfreq

import (
	"reflect"
	"testing"
)

func TestTopWords(t *testing.T) {
	text := "The cat and the hat. THE END, and then: cat!"
	got := TopWords(text, 3)
	want := []WordCount{{"the", 3}, {"and", 2}, {"cat", 2}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("TopWords(%q, 3) = %v, want %v", text, got, want)
	}
}

func TestFewerWordsThanAsked(t *testing.T) {
	got := TopWords("b a b", 10)
	want := []WordCount{{"b", 2}, {"a", 1}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestNonPositive(t *testing.T) {
	if got := TopWords("a b c", 0); got == nil || len(got) != 0 {
		t.Fatalf("got %#v, want an empty slice", got)
	}
}
