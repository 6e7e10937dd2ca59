// Command allotctl is the operator CLI for an allot allocator cluster: it
// shows who holds which leases, explains why a key is denied, manages the
// rule set and the Raft membership, and runs one-off authoritative checks.
//
// Every command talks to the Admin gRPC service of any allocator node
// (--addr); followers forward to the leader where needed. See docs/cli.md.
//
// Exit codes: 0 success, 1 error (unreachable allocator, rejected request,
// invalid rules file), 2 usage error (unknown command or flag, bad
// arguments).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2

	// rules diff, as diff(1): the files differ, or an error.
	exitDiffer    = 1
	exitDiffError = 2
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// run executes one allotctl invocation and returns its exit code. It holds
// no global state, so tests call it in-process.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return newApp(stdout, stderr).execute(ctx, args)
}

// execute runs the command line args and returns the exit code.
func (a *app) execute(ctx context.Context, args []string) int {
	defer a.close()
	stderr := a.stderr
	root := a.rootCmd()
	if args == nil {
		args = []string{} // cobra reads os.Args when given nil
	}
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return exitOK
	}
	var ee *codeError
	if errors.As(err, &ee) {
		if ee.err != nil {
			fmt.Fprintf(stderr, "allotctl: %s\n", oneLine(ee.err.Error()))
		}
		return ee.code
	}
	var re *runError
	if errors.As(err, &re) {
		fmt.Fprintf(stderr, "allotctl: %s\n", oneLine(re.err.Error()))
		return exitError
	}
	// Anything else comes from cobra itself (unknown command or flag,
	// argument count, missing required flag) or is an explicit usageError.
	fmt.Fprintf(stderr, "allotctl: %s\n", oneLine(err.Error()))
	path := root.Name()
	if cmd != nil {
		path = cmd.CommandPath()
	}
	fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", path)
	return exitUsage
}

// runError marks an error returned by a command's RunE: exit code 1.
type runError struct{ err error }

func (e *runError) Error() string { return e.err.Error() }
func (e *runError) Unwrap() error { return e.err }

// codeError ends a command with its own exit code (rules diff: 1 when the
// files differ, 2 on an error), printing err when it is not nil.
type codeError struct {
	code int
	err  error
}

func (e *codeError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit %d", e.code)
	}
	return e.err.Error()
}
func (e *codeError) Unwrap() error { return e.err }

// usageError is an argument problem a command found itself: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// oneLine keeps error output to a single line per error: multi-line server
// messages are joined with "; ".
func oneLine(s string) string {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "\n") {
		return s
	}
	parts := strings.Split(s, "\n")
	out := parts[:0]
	for _, p := range parts {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return strings.Join(out, "; ")
}
