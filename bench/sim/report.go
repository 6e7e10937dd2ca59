package main

import (
	"fmt"
	"io"
	"math"
	"strings"
	"time"
)

// result is what one scenario reports: what it simulated, its tables, the
// bounds the design promises next to the measured values, and plots.
type result struct {
	name, title string
	what        []string // what is simulated, exactly
	tables      []table
	bounds      []bound
	notes       []string
	plots       []plotSpec
}

type table struct {
	title  string
	header []string
	rows   [][]string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

// bound is one promise: measured must satisfy measured ≤ limit (or ≥ when
// atLeast). Only the lease system's bounds are checked; baselines are
// reported for comparison.
type bound struct {
	system   string
	what     string
	promise  string // where the bound comes from
	measured float64
	limit    float64
	atLeast  bool
	unit     string // "%" (values are fractions), "s", "x", "tokens", "cores", "/s", ""
	// target: a performance target rather than a guarantee the
	// design derives from its invariants (the tests assert the latter).
	target bool
}

func (b bound) ok() bool {
	if b.atLeast {
		return b.measured >= b.limit
	}
	return b.measured <= b.limit
}

func (b bound) fmtVal(v float64) string { return fmtUnit(v, b.unit) }

func fmtUnit(v float64, unit string) string {
	switch unit {
	case "%":
		return pct(v)
	case "s":
		return fmt.Sprintf("%.3f s", v)
	case "x":
		return fmt.Sprintf("%.2f×", v)
	case "tokens":
		return count(int64(math.Round(v)))
	case "cores":
		return fmt.Sprintf("%.2f cores", v)
	case "/s":
		return fmt.Sprintf("%.0f/s", v)
	}
	return fmt.Sprintf("%.4g", v)
}

func pct(v float64) string {
	switch {
	case v == 0:
		return "0%"
	case v < 0.0001 && v > -0.0001:
		return fmt.Sprintf("%.4f%%", 100*v)
	case v < 0.01 && v > -0.01:
		return fmt.Sprintf("%.3f%%", 100*v)
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

func count(n int64) string {
	s := fmt.Sprint(n)
	if n < 10000 && n > -10000 {
		return s
	}
	var b strings.Builder
	neg := n < 0
	if neg {
		s = s[1:]
		b.WriteByte('-')
	}
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func rate(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM/s", v/1e6)
	case v >= 1e4:
		return fmt.Sprintf("%.1fk/s", v/1e3)
	}
	return fmt.Sprintf("%.0f/s", v)
}

func dur(d time.Duration) string {
	switch {
	case d == 0:
		return "0"
	case d < time.Millisecond:
		return fmt.Sprintf("%d µs", d.Microseconds())
	case d < time.Second:
		return fmt.Sprintf("%.1f ms", float64(d)/1e6)
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// broken returns the bounds that failed.
func (r *result) broken() []bound {
	var out []bound
	for _, b := range r.bounds {
		if !b.ok() {
			out = append(out, b)
		}
	}
	return out
}

// writeText prints the result for a terminal. It depends only on the
// simulation (no wall-clock values), so two runs with one seed print the
// same bytes.
func (r *result) writeText(w io.Writer) {
	fmt.Fprintf(w, "\n== %s: %s ==\n", r.name, r.title)
	for _, s := range r.what {
		fmt.Fprintf(w, "  %s\n", s)
	}
	for _, t := range r.tables {
		fmt.Fprintf(w, "\n  %s\n", t.title)
		widths := make([]int, len(t.header))
		for i, h := range t.header {
			widths[i] = len([]rune(h))
		}
		for _, row := range t.rows {
			for i, c := range row {
				widths[i] = max(widths[i], len([]rune(c)))
			}
		}
		line := func(cells []string) {
			var b strings.Builder
			b.WriteString("  ")
			for i, c := range cells {
				if i > 0 {
					b.WriteString("  ")
				}
				b.WriteString(c)
				b.WriteString(strings.Repeat(" ", widths[i]-len([]rune(c))))
			}
			fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
		}
		line(t.header)
		for _, row := range t.rows {
			line(row)
		}
	}
	if len(r.bounds) > 0 {
		fmt.Fprintf(w, "\n  bounds (design promise vs measured):\n")
		for _, b := range r.bounds {
			op := "≤"
			if b.atLeast {
				op = "≥"
			}
			verdict := "ok  "
			if !b.ok() {
				verdict = "FAIL"
			}
			fmt.Fprintf(w, "  [%s] %s: %s: measured %s, bound %s %s (%s)\n",
				verdict, b.system, b.what, b.fmtVal(b.measured), op, b.fmtVal(b.limit), b.promise)
		}
	}
	for _, n := range r.notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
}

// writeMarkdown renders the result for docs/performance-sim.md.
func (r *result) writeMarkdown(w io.Writer, imgDir string) {
	fmt.Fprintf(w, "\n#### %s: %s\n\n", r.name, r.title)
	for _, s := range r.what {
		fmt.Fprintf(w, "%s\n", s)
	}
	for _, t := range r.tables {
		fmt.Fprintf(w, "\n%s\n\n", t.title)
		fmt.Fprintf(w, "| %s |\n", strings.Join(t.header, " | "))
		fmt.Fprintf(w, "|%s\n", strings.Repeat("---|", len(t.header)))
		for _, row := range t.rows {
			fmt.Fprintf(w, "| %s |\n", strings.Join(row, " | "))
		}
	}
	if len(r.bounds) > 0 {
		fmt.Fprintf(w, "\n| bound | promise | measured | bound | |\n|---|---|---|---|---|\n")
		for _, b := range r.bounds {
			op := "≤"
			if b.atLeast {
				op = "≥"
			}
			v := "ok"
			if !b.ok() {
				v = "**broken**"
			}
			fmt.Fprintf(w, "| %s: %s | %s | %s | %s %s | %s |\n", b.system, b.what, b.promise, b.fmtVal(b.measured), op, b.fmtVal(b.limit), v)
		}
	}
	for _, n := range r.notes {
		fmt.Fprintf(w, "\n%s\n", n)
	}
	for _, p := range r.plots {
		fmt.Fprintf(w, "\n![%s](%s/%s)\n", p.title, imgDir, p.file)
	}
}
