package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func wrkOutput(n, errs int64, pct func(i int) int64) string {
	var b strings.Builder
	b.WriteString("Running 8s test @ http://127.0.0.1:1/v1/search\n  2 threads and 16 connections\n")
	fmt.Fprintf(&b, "allot-bench n %d errors %d\n", n, errs)
	for i := 1; i <= 1000; i++ {
		fmt.Fprintf(&b, "allot-bench p %d %d\n", i, pct(i))
	}
	return b.String()
}

// TestParseWrk: the count, the errors and the percentiles come back as a
// histogram whose quantiles are wrk's.
func TestParseWrk(t *testing.T) {
	out := wrkOutput(100000, 3, func(i int) int64 { return int64(i) }) // p(i/10) = i µs
	res, err := parseWrk([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if res.n != 99997 || res.errs != 3 {
		t.Fatalf("n %d errs %d, want 99997 and 3", res.n, res.errs)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{50, 500 * time.Microsecond}, {99, 990 * time.Microsecond}, {99.9, 999 * time.Microsecond}} {
		got := time.Duration(res.h.ValueAtQuantile(c.q))
		if d := got - c.want; d < -2*time.Microsecond || d > 2*time.Microsecond {
			t.Errorf("p%v = %v, want %v", c.q, got, c.want)
		}
	}
	for _, bad := range []string{
		"",
		"allot-bench n 10 errors 0\n", // no percentiles
		strings.Replace(out, "allot-bench p 500 500", "allot-bench p 500 x", 1),
		strings.Replace(out, "allot-bench n 100000 errors 3", "allot-bench n x errors 3", 1),
	} {
		if _, err := parseWrk([]byte(bad)); err == nil {
			t.Errorf("parseWrk accepted %.60q…", bad)
		}
	}
}

// FuzzParseWrk: any output is parsed or refused, never a panic.
func FuzzParseWrk(f *testing.F) {
	f.Add([]byte(wrkOutput(1000, 0, func(i int) int64 { return int64(i) * 3 })))
	f.Add([]byte("allot-bench n -5 errors 9\nallot-bench p 1 -1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = parseWrk(b)
	})
}
