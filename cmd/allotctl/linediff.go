package main

import (
	"fmt"
	"io"
	"strings"
)

// A line diff for `rules diff`: Myers' O(ND) shortest edit script, printed
// as unified-diff hunks.

// edit is one line of an edit script: op ' ' (kept), '-' (only in a) or
// '+' (only in b).
type edit struct {
	op   byte
	line string
}

// maxDiffD bounds the edit distance the diff searches (memory grows as
// D²); beyond it the script is "delete all, insert all", which is correct,
// only not minimal.
const maxDiffD = 2000

// splitLines splits text into lines without their terminators; a final
// newline does not start another line.
func splitLines(s string) []string {
	if s == "" {
		return nil
	}
	s = strings.TrimSuffix(s, "\n")
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimSuffix(l, "\r")
	}
	return lines
}

// diffLines returns a shortest edit script turning a into b (for edit
// distances up to maxDiffD).
func diffLines(a, b []string) []edit {
	// Trim the common prefix and suffix: rules edits are usually small.
	pre := 0
	for pre < len(a) && pre < len(b) && a[pre] == b[pre] {
		pre++
	}
	suf := 0
	for suf < len(a)-pre && suf < len(b)-pre && a[len(a)-1-suf] == b[len(b)-1-suf] {
		suf++
	}
	out := make([]edit, 0, len(a)+len(b))
	for _, l := range a[:pre] {
		out = append(out, edit{' ', l})
	}
	out = append(out, myers(a[pre:len(a)-suf], b[pre:len(b)-suf])...)
	for _, l := range a[len(a)-suf:] {
		out = append(out, edit{' ', l})
	}
	return out
}

func myers(a, b []string) []edit {
	n, m := len(a), len(b)
	if n == 0 && m == 0 {
		return nil
	}
	dMax := min(n+m, maxDiffD)
	off := dMax + 1
	v := make([]int, 2*dMax+3)
	// trace[d] holds v[k] for k in [-d-1, d+1] as it was before step d.
	var trace [][]int
	for d := 0; d <= dMax; d++ {
		snap := make([]int, 2*d+3)
		copy(snap, v[off-d-1:off+d+2])
		trace = append(trace, snap)
		for k := -d; k <= d; k += 2 {
			var x int
			if k == -d || (k != d && v[off+k-1] < v[off+k+1]) {
				x = v[off+k+1] // down: insertion
			} else {
				x = v[off+k-1] + 1 // right: deletion
			}
			y := x - k
			for x < n && y < m && a[x] == b[y] {
				x++
				y++
			}
			v[off+k] = x
			if x >= n && y >= m {
				return backtrack(a, b, trace, d)
			}
		}
	}
	out := make([]edit, 0, n+m)
	for _, l := range a {
		out = append(out, edit{'-', l})
	}
	for _, l := range b {
		out = append(out, edit{'+', l})
	}
	return out
}

func backtrack(a, b []string, trace [][]int, dEnd int) []edit {
	x, y := len(a), len(b)
	rev := make([]edit, 0, x+y)
	for d := dEnd; d > 0; d-- {
		snap := trace[d]
		at := func(k int) int { return snap[k+d+1] }
		k := x - y
		var prevK int
		if k == -d || (k != d && at(k-1) < at(k+1)) {
			prevK = k + 1
		} else {
			prevK = k - 1
		}
		prevX := at(prevK)
		prevY := prevX - prevK
		for x > prevX && y > prevY {
			rev = append(rev, edit{' ', a[x-1]})
			x--
			y--
		}
		if x == prevX {
			rev = append(rev, edit{'+', b[y-1]})
		} else {
			rev = append(rev, edit{'-', a[x-1]})
		}
		x, y = prevX, prevY
	}
	for x > 0 && y > 0 {
		rev = append(rev, edit{' ', a[x-1]})
		x--
		y--
	}
	for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
		rev[i], rev[j] = rev[j], rev[i]
	}
	return rev
}

// writeUnified prints the script as unified-diff hunks with ctx lines of
// context, under "--- from" / "+++ to" headers. It prints nothing when the
// script has no change and reports whether it printed.
func writeUnified(w io.Writer, from, to string, script []edit, ctx int) bool {
	changed := false
	for _, e := range script {
		if e.op != ' ' {
			changed = true
			break
		}
	}
	if !changed {
		return false
	}
	fmt.Fprintf(w, "--- %s\n+++ %s\n", from, to)
	// aLine[i], bLine[i]: 0-based line numbers in a and b before script[i].
	aLine := make([]int, len(script)+1)
	bLine := make([]int, len(script)+1)
	for i, e := range script {
		aLine[i+1], bLine[i+1] = aLine[i], bLine[i]
		if e.op != '+' {
			aLine[i+1]++
		}
		if e.op != '-' {
			bLine[i+1]++
		}
	}
	i := 0
	for i < len(script) {
		for i < len(script) && script[i].op == ' ' {
			i++
		}
		if i == len(script) {
			break
		}
		start := max(i-ctx, 0)
		// Extend the hunk while the next change is within 2·ctx lines.
		end := i
		for {
			for end < len(script) && script[end].op != ' ' {
				end++
			}
			j := end
			for j < len(script) && script[j].op == ' ' && j-end < 2*ctx {
				j++
			}
			if j < len(script) && script[j].op != ' ' {
				end = j
				continue
			}
			break
		}
		stop := min(end+ctx, len(script))
		aN := aLine[stop] - aLine[start]
		bN := bLine[stop] - bLine[start]
		fmt.Fprintf(w, "@@ -%s +%s @@\n", hunkRange(aLine[start], aN), hunkRange(bLine[start], bN))
		for _, e := range script[start:stop] {
			fmt.Fprintf(w, "%c%s\n", e.op, e.line)
		}
		i = stop
	}
	return true
}

// hunkRange renders a unified-diff range: 1-based start, and for an empty
// range the line before it.
func hunkRange(start0, n int) string {
	switch n {
	case 0:
		return fmt.Sprintf("%d,0", start0)
	case 1:
		return fmt.Sprintf("%d", start0+1)
	}
	return fmt.Sprintf("%d,%d", start0+1, n)
}
