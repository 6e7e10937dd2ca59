package main

import (
	"os"
	"strconv"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// defaultWidth is the width top fits when it cannot learn the terminal's.
const defaultWidth = 80

// terminalSize returns stdout's terminal size, or ok false when stdout is
// not a terminal.
func (a *app) terminalSize() (width, height int, ok bool) {
	f, isFile := a.stdout.(*os.File)
	if !isFile {
		return 0, 0, false
	}
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	if err != nil || ws.Col == 0 {
		return 0, 0, false
	}
	return int(ws.Col), int(ws.Row), true
}

// topWidth is the width top fits its table to: --width, else the
// terminal's width, else $COLUMNS, else 80.
func (a *app) topWidth(flag int) int {
	if flag > 0 {
		return flag
	}
	if w, _, ok := a.termSize(); ok {
		return w
	}
	if c, err := strconv.Atoi(os.Getenv("COLUMNS")); err == nil && c > 0 {
		return c
	}
	return defaultWidth
}

// top's columns, in order.
const (
	colKey = iota
	colGrant
	colDeny
	colTokens
	colAgents
	colRule
)

// topGap is the space between two columns (newTable's padding).
const topGap = 2

// Fitting: RULE is cut to ruleWidth, then KEY is shortened in its middle
// (its end, the last entry's value, tells keys apart) down to minKey; if
// that is not enough, columns are left out in dropOrder, then KEY gives
// way to at most minKeyLast.
const (
	ruleWidth  = 16
	minKey     = 24
	minKeyLast = 8
)

// fitTop fits the table rows (header first, cells already sanitised by
// cell) into width columns: it returns the rows of the columns shown, with
// cells shortened. The rate column top is ordered by is never left out.
func fitTop(rows [][]string, width int, order string) [][]string {
	cols := []int{colKey, colGrant, colDeny, colTokens, colAgents, colRule}
	dropOrder := []int{colAgents, colRule, colTokens, colDeny}
	if order == "deny" {
		dropOrder[3] = colGrant
	}
	colWidth := func(c int) int {
		w := 0
		for _, r := range rows {
			w = max(w, utf8.RuneCountInString(r[c]))
		}
		return w
	}
	total := func() int {
		t := topGap * (len(cols) - 1)
		for _, c := range cols {
			t += colWidth(c)
		}
		return t
	}
	shorten := func(c, w int) {
		for _, r := range rows[1:] {
			r[c] = elide(r[c], w, c == colKey)
		}
	}
	if total() > width {
		shorten(colRule, max(ruleWidth, utf8.RuneCountInString(rows[0][colRule])))
	}
	if over := total() - width; over > 0 {
		shorten(colKey, max(minKey, colWidth(colKey)-over))
	}
	for _, c := range dropOrder {
		if total() <= width {
			break
		}
		for i, k := range cols {
			if k == c {
				cols = append(cols[:i:i], cols[i+1:]...)
				break
			}
		}
	}
	if over := total() - width; over > 0 {
		shorten(colKey, max(minKeyLast, colWidth(colKey)-over))
	}
	out := make([][]string, len(rows))
	for i, r := range rows {
		for _, c := range cols {
			out[i] = append(out[i], r[c])
		}
	}
	return out
}

// elide shortens s to at most w runes with an ellipsis: in the middle
// (keeping more of the end) or at the end.
func elide(s string, w int, middle bool) string {
	n := utf8.RuneCountInString(s)
	if n <= w || w < 2 {
		return s
	}
	rs := []rune(s)
	if !middle {
		return string(rs[:w-1]) + "…"
	}
	head := (w - 1) / 3
	tail := w - 1 - head
	return string(rs[:head]) + "…" + string(rs[n-tail:])
}
