package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/cliflags"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// defaultAddr is the allocator's default gRPC address (cmd/allocator
// -grpc-addr).
const defaultAddr = "127.0.0.1:7420"

// addrEnv, when set, replaces the default of --addr.
const addrEnv = "ALLOTCTL_ADDR"

// showKeysMetadata is allocator.ShowKeysMetadata: with it, an admin's
// leases, top and inspect answers carry raw keys.
const showKeysMetadata = "x-allot-show-keys"

// app is one invocation's state: the global flags, the output streams and
// the lazily dialled connection.
type app struct {
	stdout, stderr io.Writer

	addr      string
	output    string
	timeout   time.Duration
	tls       cliflags.TLS
	token     string
	tokenFile string
	showKeys  bool

	// isTerminal reports whether stdout is a terminal (top redraws in
	// place only then). Replaced in tests.
	isTerminal func() bool
	// termSize returns stdout's terminal size (top fits its frame to it).
	// Replaced in tests.
	termSize func() (width, height int, ok bool)

	conn   *grpc.ClientConn
	client allotv1.AdminClient
}

func newApp(stdout, stderr io.Writer) *app {
	a := &app{stdout: stdout, stderr: stderr}
	a.isTerminal = func() bool {
		f, ok := a.stdout.(*os.File)
		if !ok {
			return false
		}
		fi, err := f.Stat()
		return err == nil && fi.Mode()&os.ModeCharDevice != 0
	}
	a.termSize = a.terminalSize
	return a
}

func (a *app) close() {
	if a.conn != nil {
		_ = a.conn.Close()
		a.conn = nil
	}
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "allotctl",
		Short: "Operate an allot allocator cluster",
		Long: `allotctl inspects and operates an allot allocator cluster through its Admin
gRPC service. Point --addr at any allocator node: followers forward to the
leader where needed.

Exit codes: 0 success, 1 error, 2 usage error.`,
		Example: `  allotctl status
  allotctl --addr 10.0.0.5:7420 leases --domain public-api
  allotctl inspect --domain public-api -d tier=free -d route=/v1/search -d api_key=k_1
  allotctl rules apply -f public-api.yaml
  allotctl top --order deny`,
		SilenceErrors: true,
		SilenceUsage:  true,
		CompletionOptions: cobra.CompletionOptions{
			DisableDefaultCmd: true,
		},
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			return a.validateGlobals(cmd)
		},
	}
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{msg: err.Error()} })

	def := defaultAddr
	if env := os.Getenv(addrEnv); env != "" {
		def = env
	}
	pf := root.PersistentFlags()
	pf.StringVar(&a.addr, "addr", def, "gRPC address (host:port) of any allocator node (env "+addrEnv+")")
	pf.StringVarP(&a.output, "output", "o", "table", "output format: table|json|yaml")
	pf.DurationVar(&a.timeout, "timeout", 5*time.Second, "deadline for each request to the allocator")
	gfs := flag.NewFlagSet("allotctl", flag.ContinueOnError)
	a.tls.Register(gfs, cliflags.TLSUsage{
		Cert:   "PEM client certificate for mTLS (with --tls-key; enables TLS)",
		CA:     "PEM CA bundle to verify the allocator (enables TLS)",
		Client: true,
	})
	pf.AddGoFlagSet(gfs)
	pf.StringVar(&a.tokenFile, "admin-token-file", "", cliflags.TokenFileUsage)
	pf.StringVar(&a.token, "token", "", "bearer token sent as 'authorization: Bearer <token>' metadata")
	_ = pf.MarkDeprecated("token", "a secret on a command line is visible to other users of the host; use --admin-token-file")
	pf.BoolVar(&a.showKeys, "show-keys", false, "ask for raw keys in leases, top and inspect (served to the admin role only; redacted otherwise)")
	_ = root.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(
		[]string{"table", "json", "yaml"}, cobra.ShellCompDirectiveNoFileComp))

	root.AddCommand(
		a.statusCmd(),
		a.leasesCmd(),
		a.inspectCmd(),
		a.agentsCmd(),
		a.rulesCmd(),
		a.topCmd(),
		a.clusterCmd(),
		a.slotsCmd(),
		a.groupsCmd(),
		a.checkCmd(),
		a.completionCmd(root),
	)
	root.InitDefaultHelpCmd()
	for _, c := range root.Commands() {
		if c.Name() == "help" {
			c.Example = "  allotctl help inspect\n  allotctl help rules apply"
		}
	}
	markRunErrors(root)
	return root
}

// markRunErrors wraps every RunE so that its errors are runErrors (exit 1)
// unless they are explicit usageErrors (exit 2). Errors cobra returns before
// RunE runs (flags, argument counts) stay unwrapped and exit 2.
func markRunErrors(c *cobra.Command) {
	if f := c.RunE; f != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			err := f(cmd, args)
			if err == nil {
				return nil
			}
			var ue *usageError
			if errors.As(err, &ue) {
				return err
			}
			return &runError{err: err}
		}
	}
	for _, sub := range c.Commands() {
		markRunErrors(sub)
	}
}

// groupRunE serves commands that only group subcommands: no argument prints
// the help, an argument is an unknown subcommand (usage error).
func groupRunE(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("unknown command %q for %q", args[0], cmd.CommandPath())
	}
	return cmd.Help()
}

func (a *app) validateGlobals(cmd *cobra.Command) error {
	switch a.output {
	case "table", "json", "yaml":
	default:
		return usagef("invalid --output %q: want table, json or yaml", a.output)
	}
	if a.timeout <= 0 {
		return usagef("invalid --timeout %s: must be positive", a.timeout)
	}
	if (a.tls.Cert == "") != (a.tls.Key == "") {
		return usagef("--tls-cert and --tls-key must be given together")
	}
	if strings.TrimSpace(a.addr) == "" {
		return usagef("--addr must not be empty")
	}
	return nil
}

func (a *app) useTLS() bool {
	return a.tls.Enabled() || a.tls.ServerName != ""
}

// admin returns the Admin client, dialling on first use. grpc.NewClient
// does not block: an unreachable address surfaces as the first RPC's error.
func (a *app) admin() (allotv1.AdminClient, error) {
	if a.client != nil {
		return a.client, nil
	}
	opts, err := a.dialOptions()
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(a.addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("invalid --addr %q: %v", a.addr, err)
	}
	a.conn = conn
	a.client = allotv1.NewAdminClient(conn)
	return a.client, nil
}

func (a *app) dialOptions() ([]grpc.DialOption, error) {
	var opts []grpc.DialOption
	if a.useTLS() {
		topts, err := a.tls.Options()
		if err != nil {
			return nil, err
		}
		cfg := &tls.Config{MinVersion: topts.MinVersion, ServerName: a.tls.ServerName}
		if a.tls.CA != "" {
			pem, err := os.ReadFile(a.tls.CA)
			if err != nil {
				return nil, fmt.Errorf("read --tls-ca: %v", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("--tls-ca %s: no PEM certificates found", a.tls.CA)
			}
			cfg.RootCAs = pool
		}
		if a.tls.Cert != "" {
			cert, err := tls.LoadX509KeyPair(a.tls.Cert, a.tls.Key)
			if err != nil {
				return nil, fmt.Errorf("load --tls-cert/--tls-key: %v", err)
			}
			cfg.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	token := a.token
	if a.tokenFile != "" {
		var err error
		if token, err = cliflags.ReadToken(a.tokenFile); err != nil {
			return nil, err
		}
	}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: token, requireTLS: false}))
	}
	if a.showKeys {
		opts = append(opts, grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any,
			cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(metadata.AppendToOutgoingContext(ctx, showKeysMetadata, "1"), method, req, reply, cc, opts...)
		}))
	}
	return opts, nil
}

// bearer sends the --token as "authorization: Bearer <token>" metadata. It
// is allowed over plaintext so that loopback development clusters work;
// use TLS whenever the token matters.
type bearer struct {
	token      string
	requireTLS bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.requireTLS }

// rpcCtx bounds one request (or one command's requests) by --timeout.
func (a *app) rpcCtx(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, a.timeout)
}

// rpcErr turns a gRPC error into a short, actionable message. op names the
// operation ("ListLeases") for messages that need it.
func (a *app) rpcErr(op string, err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("allocator at %s did not answer within %s (--timeout)", a.addr, a.timeout)
		}
		if errors.Is(err, context.Canceled) {
			return errors.New("interrupted")
		}
		return err
	}
	msg := st.Message()
	switch st.Code() {
	case codes.Unavailable:
		if isTransportFailure(msg) {
			return fmt.Errorf("cannot reach allocator at %s: %s", a.addr, transportReason(msg))
		}
		return fmt.Errorf("allocator at %s is unavailable: %s", a.addr, msg)
	case codes.DeadlineExceeded:
		return fmt.Errorf("allocator at %s did not answer within %s (--timeout)", a.addr, a.timeout)
	case codes.Canceled:
		return errors.New("interrupted")
	case codes.InvalidArgument:
		return fmt.Errorf("%s rejected: %s", op, msg)
	case codes.FailedPrecondition:
		return fmt.Errorf("%s refused: %s", op, msg)
	case codes.NotFound:
		return fmt.Errorf("%s: not found: %s", op, msg)
	case codes.Unauthenticated:
		return fmt.Errorf("allocator at %s requires authentication: %s (see --admin-token-file)", a.addr, msg)
	case codes.PermissionDenied:
		return fmt.Errorf("%s: permission denied: %s", op, msg)
	case codes.Unimplemented:
		if strings.Contains(msg, "unexpected HTTP status") || strings.Contains(msg, "content-type") {
			return fmt.Errorf("%s is not an allot allocator's gRPC port (%s); check --addr (default port 7420) and the TLS flags", a.addr, msg)
		}
		return fmt.Errorf("allocator at %s does not implement %s (%s): is it an allot allocator of a matching version?", a.addr, op, msg)
	case codes.ResourceExhausted:
		return fmt.Errorf("%s: %s", op, msg)
	}
	return fmt.Errorf("%s failed (%s): %s", op, st.Code(), msg)
}

// isTransportFailure reports whether an Unavailable status comes from the
// client's transport (dial, TLS handshake, connection reset) rather than
// from the allocator itself (for example "no leader").
func isTransportFailure(msg string) bool {
	for _, s := range []string{"connection error", "transport:", "dial ", "connection refused",
		"name resolver", "produced zero addresses", "connection reset", "connection closed", "EOF"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// transportReason extracts the root cause from grpc's transport message,
// e.g. `connection error: desc = "transport: Error while dialing: dial tcp
// 127.0.0.1:7420: connect: connection refused"` → "connection refused".
func transportReason(msg string) string {
	s := msg
	if i := strings.Index(s, `desc = "`); i >= 0 {
		s = strings.TrimSuffix(s[i+len(`desc = "`):], `"`)
	}
	s = strings.TrimPrefix(s, "transport: ")
	s = strings.TrimPrefix(s, "Error while dialing: ")
	s = strings.TrimPrefix(s, "error while dialing: ")
	if i := strings.LastIndex(s, "connect: "); i >= 0 {
		return s[i+len("connect: "):]
	}
	if strings.HasPrefix(s, "dial tcp") {
		if i := strings.LastIndex(s, ": "); i >= 0 {
			return s[i+2:]
		}
	}
	return s
}

// adminRPC is an Admin method as a method expression, for runAdmin:
// allotv1.AdminClient.ListAgents, say.
type adminRPC[Req, Resp proto.Message] func(allotv1.AdminClient, context.Context, Req, ...grpc.CallOption) (Resp, error)

// runAdmin makes one Admin call (op names it in errors) and prints the
// answer: the message itself with -o json|yaml, else through table.
func runAdmin[Req, Resp proto.Message](a *app, parent context.Context, op string, call adminRPC[Req, Resp], req Req, table func(Resp) error) error {
	c, err := a.admin()
	if err != nil {
		return err
	}
	ctx, cancel := a.rpcCtx(parent)
	defer cancel()
	resp, err := call(c, ctx, req)
	if err != nil {
		return a.rpcErr(op, err)
	}
	if a.structured() {
		return a.writeProto(resp)
	}
	return table(resp)
}
