package main

import (
	"bytes"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// ANSI: cursor home, clear screen.
const clearScreen = "\x1b[H\x1b[2J"

func (a *app) topCmd() *cobra.Command {
	var (
		req      allotv1.TopKeysRequest
		limit    int
		interval time.Duration
		once     bool
		width    int
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live view of the hottest keys by grant or deny rate",
		Long: `top polls the allocator every --interval and shows the hottest keys, ordered
by recent grant rate (tokens/s) or deny rate (requests/s reported by the
agents), with the global tokens left, the number of agents holding leases
and the rule. On a terminal the view is redrawn in place; otherwise each
refresh is printed below the previous one. Ctrl-C stops it. --once prints a
single table and exits.

The table fits the terminal's width (80 columns when it is unknown, or
--width): the rule is cut, the key shortened in its middle, and if that is
not enough the AGENTS, RULE, TOKENS and the other rate column are left out,
in that order. On a terminal, rows that do not fit its height are not shown.`,
		Example: `  allotctl top
  allotctl top --order deny --domain public-api --limit 10
  allotctl top --once -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.Order != "grant" && req.Order != "deny" {
				return usagef("invalid --order %q: want grant or deny", req.Order)
			}
			if limit < 1 || limit > allotv1.MaxPageSize {
				return usagef("invalid --limit %d: want 1..1000", limit)
			}
			if interval < 100*time.Millisecond {
				return usagef("invalid --interval %s: want ≥ 100ms", interval)
			}
			req.Limit = int32(limit)
			c, err := a.admin()
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			tty := !once && !a.structured() && a.isTerminal()
			ticker := time.NewTicker(interval)
			defer ticker.Stop()
			for first := true; ; first = false {
				rctx, cancel := a.rpcCtx(ctx)
				resp, err := c.TopKeys(rctx, &req)
				cancel()
				switch {
				case err != nil && ctx.Err() != nil:
					return nil // interrupted
				case err != nil && (first || once):
					return a.rpcErr("TopKeys", err)
				case err != nil:
					// A live view survives a leader election or a blip: show
					// the error and keep polling.
					if tty {
						fmt.Fprint(a.stdout, clearScreen)
					}
					fmt.Fprintf(a.stderr, "allotctl: %s (retrying every %s)\n", a.rpcErr("TopKeys", err), interval)
				default:
					if err := a.printTop(resp, req.Order, tty, width); err != nil {
						return err
					}
				}
				if once {
					return nil
				}
				select {
				case <-ctx.Done():
					return nil
				case <-ticker.C:
				}
			}
		},
	}
	f := cmd.Flags()
	f.DurationVar(&interval, "interval", time.Second, "refresh interval")
	f.IntVar(&limit, "limit", 20, "number of keys to show")
	f.StringVar(&req.Order, "order", "grant", "order by grant rate or deny rate: grant|deny")
	f.StringVar(&req.Domain, "domain", "", "only keys of this domain")
	f.BoolVar(&once, "once", false, "print one table and exit")
	f.IntVar(&width, "width", 0, "fit the table to this many columns (default: the terminal's width, $COLUMNS, or 80)")
	_ = cmd.RegisterFlagCompletionFunc("order", cobra.FixedCompletions(
		[]string{"grant", "deny"}, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

// printTop renders one refresh. The frame is built in memory and written
// at once so that a terminal redraw does not flicker.
func (a *app) printTop(r *allotv1.TopKeysResponse, order string, tty bool, width int) error {
	if a.structured() {
		return a.writeProto(r)
	}
	var b bytes.Buffer
	if tty {
		b.WriteString(clearScreen)
	}
	by := "grant rate"
	if order == "deny" {
		by = "deny rate"
	}
	noun := "keys"
	if len(r.GetKeys()) == 1 {
		noun = "key"
	}
	fmt.Fprintf(&b, "Top %d %s by %s at %s\n", len(r.GetKeys()), noun, by, fmtUnixMS(r.GetNowUnixMs()))
	hidden := 0
	if len(r.GetKeys()) == 0 {
		b.WriteString("No active keys.\n")
	} else {
		keys := r.GetKeys()
		if _, h, ok := a.termSize(); tty && ok && len(keys) > h-4 {
			// Title, header, the rows, a blank line and the footer (with
			// no newline after it): the frame never scrolls.
			n := max(h-4, 1)
			hidden, keys = len(keys)-n, keys[:n]
		}
		rows := [][]string{{"KEY", "GRANT/S", "DENY/S", "TOKENS", "AGENTS", "RULE"}}
		for _, k := range keys {
			rows = append(rows, []string{cell(k.GetKey()), fmtRate(k.GetGrantRate()), fmtRate(k.GetDenyRate()),
				strconv.FormatInt(k.GetTokens(), 10), strconv.FormatUint(uint64(k.GetAgents()), 10), cell(k.GetRule())})
		}
		rows = fitTop(rows, a.topWidth(width), order)
		t := newTable(&b)
		for _, row := range rows {
			t.row(row...)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	switch {
	case tty && hidden > 0:
		fmt.Fprintf(&b, "\n(%d more; Ctrl-C to quit)", hidden)
	case tty:
		b.WriteString("\n(Ctrl-C to quit)")
	default:
		b.WriteString("\n")
	}
	_, err := a.stdout.Write(b.Bytes())
	return err
}
