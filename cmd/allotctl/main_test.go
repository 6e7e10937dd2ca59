package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

type result struct {
	stdout, stderr string
	code           int
}

// runCLI runs one allotctl invocation in-process.
func runCLI(t *testing.T, args ...string) result {
	t.Helper()
	return runCLICtx(t, context.Background(), args...)
}

func runCLICtx(t *testing.T, ctx context.Context, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(ctx, args, &out, &errb)
	return result{stdout: out.String(), stderr: errb.String(), code: code}
}

// checkGolden compares got with testdata/<name>.golden; -update rewrites it.
func checkGolden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run `go test ./cmd/allotctl -update` to create it)", err)
	}
	if got != string(want) {
		var d strings.Builder
		writeUnified(&d, path, "got", diffLines(splitLines(string(want)), splitLines(got)), 3)
		t.Errorf("output differs from %s (-update rewrites it):\n%s", path, d.String())
	}
}

// goldenFails are the golden cases that exit non-zero, with their stderr:
// a rebalance whose canned answer holds an aborted move exits 1.
var goldenFails = map[string]struct {
	code   int
	stderr string
}{
	"groups_rebalance": {exitError, "allotctl: move 5 of slots 512-767 aborted: target refused the import: the leased keys exceed the arena\n"},
}

// goldenCases are the commands whose table and JSON output the fake
// server's canned answers pin.
var goldenCases = []struct {
	name string
	args []string
}{
	{"status", []string{"status"}},
	{"leases", []string{"leases"}},
	{"leases_key", []string{"leases", "--key", fakeKey}},
	{"inspect_key", []string{"inspect", fakeKey}},
	{"inspect_entries", []string{"inspect", "--domain", "public-api", "-d", "tier=free", "-d", "route=/v1/search", "-d", "api_key=k_1"}},
	{"inspect_nomatch", []string{"inspect", "public-api:tier=gold"}},
	{"agents", []string{"agents"}},
	{"top", []string{"top", "--once"}},
	{"top_deny", []string{"top", "--once", "--order", "deny", "--limit", "1"}},
	{"top_width40", []string{"top", "--once", "--width", "40"}},
	{"check", []string{"check", "--domain", "public-api", "-d", "tier=free", "-d", "route=/v1/search", "-d", "api_key=k_1"}},
	{"check_multi", []string{"check", "--domain", "public-api", "--hits", "2",
		"-D", "tier=free,api_key=k_1", "-D", "tier=free,route=/v1/search,api_key=k_1", "-D", "api_key=k_live_abc123"}},
	{"cluster_join", []string{"cluster", "join", "10.0.0.4:7420", "--id", "alloc-4", "--raft-addr", "10.0.0.4:7421", "--http-addr", "10.0.0.4:7422"}},
	{"cluster_remove", []string{"cluster", "remove", "alloc-3"}},
	{"cluster_transfer", []string{"cluster", "transfer-leader"}},
	{"cluster_transfer_id", []string{"cluster", "transfer-leader", "alloc-3"}},
	{"slots_move", []string{"slots", "move", "--slots", "0-63", "--to", "2"}},
	{"groups_rebalance", []string{"groups", "rebalance"}},
	{"groups_add", []string{"groups", "add"}},
	{"rules_get", []string{"rules", "get"}},
	{"rules_get_domain", []string{"rules", "get", "--domain", "public-api"}},
}

func TestGoldenFake(t *testing.T) {
	t.Setenv("COLUMNS", "") // top fits 80 columns
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	for _, tc := range goldenCases {
		for _, format := range []string{"table", "json"} {
			name := tc.name
			if format != "table" {
				name += "." + format
			}
			t.Run(name, func(t *testing.T) {
				args := append([]string{"--addr", addr, "-o", format}, tc.args...)
				r := runCLI(t, args...)
				want := goldenFails[tc.name]
				if r.code != want.code {
					t.Fatalf("allotctl %s: exit %d, want %d; stderr %q", strings.Join(tc.args, " "), r.code, want.code, r.stderr)
				}
				if r.stderr != want.stderr {
					t.Errorf("stderr %q, want %q", r.stderr, want.stderr)
				}
				checkGolden(t, "fake_"+name, r.stdout)
			})
		}
	}
	t.Run("status.yaml", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "-o", "yaml", "status")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		checkGolden(t, "fake_status.yaml", r.stdout)
	})
}

// TestRequestsSent checks what the CLI puts on the wire: entry order, paging,
// filters, the check's descriptors.
func TestRequestsSent(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)

	t.Run("inspect keeps -d order", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "inspect", "--domain", "d", "-d", "z=1", "-d", "a=x=y,z", "-d", "m=")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		want := &allotv1.InspectKeyRequest{Domain: "d", Entries: []*allotv1.Entry{
			{Key: "z", Value: "1"}, {Key: "a", Value: "x=y,z"}, {Key: "m", Value: ""}}}
		if got := f.last("InspectKey"); !proto.Equal(got, want) {
			t.Errorf("InspectKey request = %v, want %v", got, want)
		}
	})

	t.Run("leases follows page tokens", func(t *testing.T) {
		f.mu.Lock()
		f.pageSize = 1
		f.mu.Unlock()
		defer func() { f.mu.Lock(); f.pageSize = 0; f.mu.Unlock() }()
		before := f.numCalls("ListLeases")
		r := runCLI(t, "--addr", addr, "-o", "json", "leases", "--domain", "public-api")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		if n := f.numCalls("ListLeases") - before; n != 3 {
			t.Errorf("ListLeases called %d times, want 3 (one per page)", n)
		}
		if n := strings.Count(r.stdout, `"agent_id"`); n != 3 {
			t.Errorf("printed %d leases, want 3:\n%s", n, r.stdout)
		}
		last := f.last("ListLeases").(*allotv1.ListLeasesRequest)
		if last.Domain != "public-api" || last.PageToken != "2" {
			t.Errorf("last ListLeases request = %v, want domain public-api, page token 2", last)
		}
	})

	t.Run("leases --limit stops early", func(t *testing.T) {
		f.mu.Lock()
		f.pageSize = 1
		f.mu.Unlock()
		defer func() { f.mu.Lock(); f.pageSize = 0; f.mu.Unlock() }()
		before := f.numCalls("ListLeases")
		r := runCLI(t, "--addr", addr, "leases", "--limit", "2")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		if n := f.numCalls("ListLeases") - before; n != 2 {
			t.Errorf("ListLeases called %d times, want 2", n)
		}
		if got := f.last("ListLeases").(*allotv1.ListLeasesRequest).PageSize; got != 1 {
			t.Errorf("page size of the second call = %d, want 1 (what is left of --limit)", got)
		}
		if !strings.Contains(r.stderr, "more leases not shown") {
			t.Errorf("stderr %q does not say leases were left out", r.stderr)
		}
	})

	t.Run("check descriptors and hits", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "check", "--domain", "public-api", "--hits", "3",
			"-d", "tier=free", "-D", `a=1,b=x\,y,c=\\`)
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		want := &allotv1.CheckRequest{Domain: "public-api", Hits: 3, Descriptors: []*allotv1.Descriptor{
			{Entries: []*allotv1.Entry{{Key: "tier", Value: "free"}}},
			{Entries: []*allotv1.Entry{{Key: "a", Value: "1"}, {Key: "b", Value: "x,y"}, {Key: "c", Value: `\`}}},
		}}
		if got := f.last("Check"); !proto.Equal(got, want) {
			t.Errorf("Check request = %v, want %v", got, want)
		}
	})

	t.Run("top passes limit, order, domain", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "top", "--once", "--limit", "7", "--order", "deny", "--domain", "public-api")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		want := &allotv1.TopKeysRequest{Limit: 7, Order: "deny", Domain: "public-api"}
		if got := f.last("TopKeys"); !proto.Equal(got, want) {
			t.Errorf("TopKeys request = %v, want %v", got, want)
		}
	})

	t.Run("cluster join", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "cluster", "join", "h:1", "--id", "n4", "--raft-addr", "h:2")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		want := &allotv1.AddVoterRequest{Id: "n4", RaftAddr: "h:2", GrpcAddr: "h:1"}
		if got := f.last("AddVoter"); !proto.Equal(got, want) {
			t.Errorf("AddVoter request = %v, want %v", got, want)
		}
	})

	t.Run("bearer token", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "--token", "s3cret", "agents")
		if r.code != exitOK {
			t.Fatalf("exit %d: %s", r.code, r.stderr)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if len(f.authz) == 0 || f.authz[len(f.authz)-1] != "Bearer s3cret" {
			t.Errorf("authorization metadata = %q, want \"Bearer s3cret\"", f.authz)
		}
	})
}

func TestExitCodes(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	dead := testproc.FreeAddr(t)

	cases := []struct {
		name       string
		args       []string
		code       int
		stderr     string // exact, when set
		stderrHas  string // substring, when set
		stdoutHave string
	}{
		{name: "ok", args: []string{"--addr", addr, "status"}, code: 0, stdoutHave: "alloc-1"},
		{name: "no args prints help", args: nil, code: 0, stdoutHave: "Available Commands"},
		{name: "help", args: []string{"inspect", "--help"}, code: 0, stdoutHave: "Examples:"},
		{name: "unknown command", args: []string{"frobnicate"}, code: 2, stderrHas: `unknown command "frobnicate"`},
		{name: "unknown subcommand", args: []string{"rules", "frob"}, code: 2, stderrHas: `unknown command "frob" for "allotctl rules"`},
		{name: "unknown flag", args: []string{"status", "--bogus"}, code: 2, stderrHas: "unknown flag: --bogus"},
		{name: "extra arg", args: []string{"status", "x"}, code: 2, stderrHas: "unknown command"},
		{name: "missing arg", args: []string{"cluster", "remove"}, code: 2, stderrHas: "accepts 1 arg(s), received 0"},
		{name: "bad slots", args: []string{"--addr", addr, "slots", "move", "--slots", "9-2", "--to", "2"}, code: 2, stderrHas: "invalid --slots \"9-2\""},
		{name: "move to the meta group", args: []string{"--addr", addr, "slots", "move", "--slots", "0-9", "--to", "0"}, code: 2, stderrHas: "--to must name a data group"},
		{name: "move without --to", args: []string{"--addr", addr, "slots", "move", "--slots", "0-9"}, code: 2, stderrHas: "\"to\" not set"},
		{name: "missing required flag", args: []string{"cluster", "join", "h:1"}, code: 2, stderrHas: `required flag(s) "id", "raft-addr" not set`},
		{name: "bad output", args: []string{"-o", "xml", "status"}, code: 2, stderrHas: `invalid --output "xml"`},
		{name: "bad timeout", args: []string{"--timeout", "0s", "status"}, code: 2, stderrHas: "invalid --timeout"},
		{name: "cert without key", args: []string{"--tls-cert", "c.pem", "status"}, code: 2, stderrHas: "--tls-cert and --tls-key must be given together"},
		{name: "inspect nothing", args: []string{"inspect"}, code: 2, stderrHas: "give a canonical KEY"},
		{name: "inspect both", args: []string{"inspect", "k", "--domain", "d"}, code: 2, stderrHas: "not both"},
		{name: "inspect bad entry", args: []string{"inspect", "--domain", "d", "-d", "novalue"}, code: 2, stderrHas: `invalid -d "novalue": want key=value`},
		{name: "check no domain", args: []string{"check", "-d", "a=b"}, code: 2, stderrHas: "--domain is required"},
		{name: "check no descriptor", args: []string{"check", "--domain", "d"}, code: 2, stderrHas: "give a descriptor"},
		{name: "check zero hits", args: []string{"check", "--domain", "d", "-d", "a=b", "--hits", "0"}, code: 2, stderrHas: "--hits must be"},
		{name: "top bad order", args: []string{"top", "--order", "x"}, code: 2, stderrHas: `invalid --order "x"`},
		{name: "leases negative limit", args: []string{"leases", "--limit", "-1"}, code: 2, stderrHas: "invalid --limit"},
		{name: "completion bad shell", args: []string{"completion", "tcsh"}, code: 2, stderrHas: `invalid argument "tcsh"`},
		{name: "unreachable", args: []string{"--addr", dead, "status"}, code: 1,
			stderr: "allotctl: cannot reach allocator at " + dead + ": connection refused\n"},
		{name: "unreachable top", args: []string{"--addr", dead, "top"}, code: 1,
			stderr: "allotctl: cannot reach allocator at " + dead + ": connection refused\n"},
		{name: "unresolvable", args: []string{"--addr", "nosuchhost.invalid:7420", "agents"}, code: 1,
			stderrHas: "allotctl: cannot reach allocator at nosuchhost.invalid:7420: "},
		{name: "missing CA file", args: []string{"--addr", addr, "--tls-ca", "/nonexistent/ca.pem", "status"}, code: 1,
			stderrHas: "read --tls-ca: open /nonexistent/ca.pem"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runCLI(t, tc.args...)
			if r.code != tc.code {
				t.Errorf("exit code %d, want %d (stderr %q)", r.code, tc.code, r.stderr)
			}
			if tc.stderr != "" && r.stderr != tc.stderr {
				t.Errorf("stderr = %q, want %q", r.stderr, tc.stderr)
			}
			if tc.stderrHas != "" && !strings.Contains(r.stderr, tc.stderrHas) {
				t.Errorf("stderr = %q, want it to contain %q", r.stderr, tc.stderrHas)
			}
			if tc.stdoutHave != "" && !strings.Contains(r.stdout, tc.stdoutHave) {
				t.Errorf("stdout does not contain %q:\n%s", tc.stdoutHave, r.stdout)
			}
			if strings.Contains(r.stderr, "goroutine ") || strings.Contains(r.stderr, "panic") {
				t.Errorf("stderr looks like a crash:\n%s", r.stderr)
			}
			if tc.code == exitUsage && !strings.Contains(r.stderr, "--help' for usage") {
				t.Errorf("usage error without the help hint: %q", r.stderr)
			}
		})
	}
}

// TestServerErrors pins the messages for errors the allocator returns.
func TestServerErrors(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	cases := []struct {
		method string
		err    error
		args   []string
		stderr string
	}{
		{"InspectKey", status.Error(codes.InvalidArgument, "allocator: key longer than 4096 bytes"),
			[]string{"inspect", "k"}, "allotctl: InspectKey rejected: allocator: key longer than 4096 bytes\n"},
		{"ClusterStatus", status.Error(codes.Unavailable, "allocator: no leader (election in progress)"),
			[]string{"status"}, "allotctl: allocator at " + addr + " is unavailable: allocator: no leader (election in progress)\n"},
		{"RemoveServer", status.Error(codes.NotFound, "allocator: no server n9"),
			[]string{"cluster", "remove", "n9"}, "allotctl: RemoveServer: not found: allocator: no server n9\n"},
		{"ListAgents", status.Error(codes.Unauthenticated, "missing bearer token"),
			[]string{"agents"}, "allotctl: allocator at " + addr + " requires authentication: missing bearer token (see --admin-token-file)\n"},
		{"MoveSlots", status.Error(codes.InvalidArgument, "meta: no such group: move slots 0-63 to group 9: group 9 does not exist"),
			[]string{"slots", "move", "--slots", "0-63", "--to", "9"}, "allotctl: MoveSlots rejected: meta: no such group: move slots 0-63 to group 9: group 9 does not exist\n"},
		{"RebalanceSlots", status.Error(codes.FailedPrecondition, "meta: slots already moving: 1 moves in flight"),
			[]string{"groups", "rebalance"}, "allotctl: RebalanceSlots refused: meta: slots already moving: 1 moves in flight\n"},
		{"TopKeys", status.Error(codes.Internal, "boom\nsecond line"),
			[]string{"top", "--once"}, "allotctl: TopKeys failed (Internal): boom; second line\n"},
	}
	for _, tc := range cases {
		t.Run(tc.method, func(t *testing.T) {
			f.setErr(tc.method, tc.err)
			defer f.setErr(tc.method, nil)
			r := runCLI(t, append([]string{"--addr", addr}, tc.args...)...)
			if r.code != exitError {
				t.Errorf("exit code %d, want 1", r.code)
			}
			if r.stderr != tc.stderr {
				t.Errorf("stderr = %q, want %q", r.stderr, tc.stderr)
			}
		})
	}

	t.Run("deadline", func(t *testing.T) {
		block := make(chan struct{})
		f.mu.Lock()
		f.block["ListAgents"] = block
		f.mu.Unlock()
		defer func() {
			f.mu.Lock()
			delete(f.block, "ListAgents")
			f.mu.Unlock()
			close(block)
		}()
		r := runCLI(t, "--addr", addr, "--timeout", "200ms", "agents")
		want := "allotctl: allocator at " + addr + " did not answer within 200ms (--timeout)\n"
		if r.code != exitError || r.stderr != want {
			t.Errorf("exit %d, stderr %q; want exit 1, %q", r.code, r.stderr, want)
		}
	})

	t.Run("not a gRPC server", func(t *testing.T) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				// An HTTP/1 server's answer to the HTTP/2 preface.
				c.Write([]byte("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
				c.Close()
			}
		}()
		defer func() { lis.Close(); <-done }()
		r := runCLI(t, "--addr", lis.Addr().String(), "--timeout", "2s", "status")
		if r.code != exitError || !strings.HasPrefix(r.stderr, "allotctl: ") || strings.Count(r.stderr, "\n") != 1 {
			t.Errorf("exit %d, stderr %q; want exit 1 and one short line", r.code, r.stderr)
		}
	})
}

// TestTopRefreshes runs top without --once against the fake: plain
// frames one after another when stdout is not a terminal, ANSI redraws
// when it is; the command stops cleanly when its context ends (as on
// SIGINT).
func TestTopRefreshes(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	for _, tty := range []bool{false, true} {
		t.Run(map[bool]string{false: "pipe", true: "terminal"}[tty], func(t *testing.T) {
			before := f.numCalls("TopKeys")
			ctx, cancel := context.WithCancel(context.Background())
			var out, errb safeBuffer
			a := newApp(&out, &errb)
			a.isTerminal = func() bool { return tty }
			done := make(chan int, 1)
			go func() { done <- a.execute(ctx, []string{"--addr", addr, "top", "--interval", "100ms"}) }()
			// Wait for three frames on the output, not three calls: the third
			// call is counted before its answer is drawn.
			deadline := time.Now().Add(10 * time.Second)
			for f.numCalls("TopKeys")-before < 3 || strings.Count(out.String(), "Top 2 keys by grant rate") < 3 {
				if time.Now().After(deadline) {
					t.Fatal("top did not refresh 3 times within 10s")
				}
				time.Sleep(10 * time.Millisecond)
			}
			cancel()
			select {
			case code := <-done:
				if code != exitOK {
					t.Errorf("exit %d after interrupt, want 0 (stderr %q)", code, errb.String())
				}
			case <-time.After(10 * time.Second):
				t.Fatal("top did not stop after its context ended")
			}
			s := out.String()
			if n := strings.Count(s, "Top 2 keys by grant rate"); n < 3 {
				t.Errorf("%d frames, want ≥ 3:\n%s", n, s)
			}
			if got := strings.Count(s, clearScreen); tty && got < 3 {
				t.Errorf("terminal: %d screen clears, want one per frame", got)
			} else if !tty && got != 0 {
				t.Errorf("pipe: %d ANSI screen clears, want none", got)
			}
		})
	}
}

// TestEveryCommandHasExamples: every command's --help shows examples.
func TestEveryCommandHasExamples(t *testing.T) {
	root := newApp(io.Discard, io.Discard).rootCmd()
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if c.Example == "" {
			t.Errorf("%q has no Example", c.CommandPath())
		}
		r := runCLI(t, append(strings.Fields(c.CommandPath())[1:], "--help")...)
		if r.code != exitOK || !strings.Contains(r.stdout, "Examples:") {
			t.Errorf("%s --help: exit %d, no Examples section:\n%s", c.CommandPath(), r.code, r.stdout)
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}

func TestCompletionScripts(t *testing.T) {
	for shell, marker := range map[string]string{"bash": "__allotctl", "zsh": "#compdef allotctl", "fish": "complete -c allotctl"} {
		r := runCLI(t, "completion", shell)
		if r.code != exitOK || !strings.Contains(r.stdout, marker) {
			t.Errorf("completion %s: exit %d, output lacks %q", shell, r.code, marker)
		}
	}
}

func TestAddrFromEnvironment(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	t.Setenv(addrEnv, addr)
	if r := runCLI(t, "agents"); r.code != exitOK || !strings.Contains(r.stdout, "gw-a-101-x1") {
		t.Errorf("with %s=%s: exit %d, stderr %q", addrEnv, addr, r.code, r.stderr)
	}
	// --addr wins over the environment.
	dead := testproc.FreeAddr(t)
	if r := runCLI(t, "--addr", dead, "agents"); r.code != exitError || !strings.Contains(r.stderr, dead) {
		t.Errorf("--addr %s: exit %d, stderr %q", dead, r.code, r.stderr)
	}
}

// TestTopFitsTerminal: at 80×24, top's frame is at most 80 columns wide and
// 24 lines high, with no newline after its last line, so a redraw never
// wraps a row or scrolls the header away; the rows that do not fit are
// counted in the footer.
func TestTopFitsTerminal(t *testing.T) {
	resp := &allotv1.TopKeysResponse{NowUnixMs: fakeNow}
	for i := range 30 {
		resp.Keys = append(resp.Keys, &allotv1.KeyRate{
			Key:       fmt.Sprintf("public-api:tier=enterprise,route=/v1/items/{id},api_key=k_live_%04d", i),
			GrantRate: 1234.5, DenyRate: 12.25, Tokens: 123456, Agents: 120, Rule: "enterprise_items_per_key",
		})
	}
	var out bytes.Buffer
	a := newApp(&out, io.Discard)
	a.termSize = func() (int, int, bool) { return 80, 24, true }
	if err := a.printTop(resp, "grant", true, 0); err != nil {
		t.Fatal(err)
	}
	frame := strings.TrimPrefix(out.String(), clearScreen)
	lines := strings.Split(frame, "\n")
	if len(lines) > 24 || strings.HasSuffix(frame, "\n") {
		t.Errorf("%d lines (a trailing newline: %v), want at most 24 and none", len(lines), strings.HasSuffix(frame, "\n"))
	}
	for i, l := range lines {
		if n := utf8.RuneCountInString(l); n > 80 {
			t.Errorf("line %d is %d columns: %q", i+1, n, l)
		}
	}
	checkGolden(t, "fake_top_tty", frame)
}
