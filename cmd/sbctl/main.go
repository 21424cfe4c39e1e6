// Command sbctl is the sandbox broker's CLI: create, reuse, list and control sandboxes, lend them to
// agent servers, and follow their events.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"
	"sigs.k8s.io/yaml"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/cmd/sbctl/quietterm"
	"github.com/sbxbroker/broker/protocol"
)

// Exit codes, stable for scripts.
const (
	exitError       = 1 // anything else
	exitUsage       = 2 // bad flags or arguments
	exitNotFound    = 3 // the sandbox (or key, token) does not exist
	exitAuth        = 4 // missing, invalid or insufficient credentials
	exitConflict    = 5 // name taken, wrong state (stopped, failed)
	exitUnreachable = 6 // the broker could not be reached
	exitLimited     = 7 // refused by a limit of the org or the broker (quota_exceeded, rate_limited)
)

// globals are the flags every command shares.
type globals struct {
	broker string
	apiKey string
	output string
	config string
	quiet  bool
	// brokerURL is the broker URL client() settled on, for messages about it.
	brokerURL string
	stdout    io.Writer
	stderr    io.Writer
	stdin     io.Reader
	isTTY     bool
}

func main() {
	quietterm.Restore()
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		sig := <-sigs
		// The first signal ends the command cleanly; a second one kills sbctl at once.
		signal.Reset(os.Interrupt, syscall.SIGTERM)
		cancel(interrupted{sig.(syscall.Signal)})
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// interrupted is the cause of run's context when a signal (Ctrl-C, SIGTERM) ended it.
type interrupted struct{ sig syscall.Signal }

func (i interrupted) Error() string { return "interrupted by " + i.sig.String() }

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	g := &globals{stdout: stdout, stderr: stderr, stdin: stdin, isTTY: isTerminal(stdin)}
	root := rootCmd(g)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	// Only sbctl's own commandExit passes a code through (sbctl exec and shell exit with the
	// command's): any other error with an ExitCode, such as a failed git's *exec.ExitError under
	// push, diff or pull, is reported like every error, not taken for the sandbox command's exit.
	var ce commandExit
	if errors.As(err, &ce) {
		return ce.ExitCode()
	}
	if _, ok := err.(silent); ok {
		return exitCodeOf(err) // reported already, e.g. a stop on exit that failed after Ctrl-C
	}
	if ctx.Err() != nil {
		// Interrupted: whatever the error says (context canceled, cancelled, a broken dial), the
		// person knows why, so no message; exit as a shell reports a signal, 128+n.
		var in interrupted
		if errors.As(context.Cause(ctx), &in) {
			return 128 + int(in.sig)
		}
		return 128 + int(syscall.SIGINT)
	}
	msg := describe(err)
	if pe := (*protocol.Error)(nil); errors.As(err, &pe) && pe.Code == protocol.CodeRouteNotFound && g.brokerURL != "" {
		// The broker's API has every route sbctl calls: a URL with a path, or another server, does not.
		msg += " (check --broker " + g.brokerURL + ": it takes the broker's base URL, e.g. http://127.0.0.1:7070)"
	}
	fmt.Fprintln(stderr, "sbctl:", termSafe(msg))
	return exitCodeOf(err)
}

func rootCmd(g *globals) *cobra.Command {
	root := &cobra.Command{
		Use:   "sbctl",
		Short: "Control sandboxes on a sandbox broker",
		Long: `sbctl creates, reuses and controls sandboxes on a sandbox broker, lends them to agent servers
with scoped delegation tokens, and follows their events.

Connection settings come from flags, then the environment (SBX_BROKER_URL, SBX_API_KEY), then the
config file (` + client.ConfigPath() + `, or $SBCTL_CONFIG), which a broker writes on its
first start on the embedded defaults.

A REF is a sandbox id (sb_...) or name.

Exit codes: 0 ok, 1 error (the sandbox refuses it: a symbolic link leading out of /workspace, a
missing directory, a file where a directory is needed), 2 usage (a wrong command line, or an
argument the broker refuses as such: a path outside /workspace, a bad --ttl), 3 not found, 4 not
authorized, 5 conflict (name taken, sandbox stopped or failed, or hosted by another broker), 6
broker unreachable or unavailable, 7 refused by a limit (see sbctl limits), 128+n ended by signal
n (130 for Ctrl-C); sbctl exec exits with the command's own code.`,
		Example: `  sbctl create dev --ttl 30m --tag thread_id=T42
  sbctl exec dev -c 'echo hi > hello.txt && ls'
  sbctl cp ./src dev:/workspace/
  sbctl run-config dev --scope fs:read,exec --allow-cmd pytest
  sbctl events dev -f
  sbctl delete dev`,
		SilenceUsage:  true,
		SilenceErrors: true,
		// sbctl alone shows the help; anything else that is not a command is a usage error (cobra's
		// own "unknown command" error would exit 1).
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			return usage.Errorf("unknown command %q%s; see sbctl --help", args[0], usage.DidYouMean(cmd, args[0]))
		},
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			switch g.output {
			case "table", "json", "yaml":
			default:
				return usage.Errorf("-o must be table, json or yaml, not %q", g.output)
			}
			if ok, why := outputAllowed(cmd, g.output); !ok {
				return usage.Errorf("%s does not print -o %s: %s", cmd.Name(), g.output, why)
			}
			return nil
		},
	}
	root.Version = client.Version()
	root.SetVersionTemplate("{{.Name}} {{.Version}}\n")
	pf := root.PersistentFlags()
	pf.StringVar(&g.broker, "broker", "", "broker URL (env SBX_BROKER_URL; default from the config file, else http://127.0.0.1:7070)")
	pf.StringVar(&g.apiKey, "api-key", "", "org API key (env SBX_API_KEY; default from the config file)")
	pf.StringVarP(&g.output, "output", "o", "table", "output format: table, json or yaml")
	pf.StringVar(&g.config, "config", "", "config file (env SBCTL_CONFIG; default "+client.ConfigPath()+")")
	pf.BoolVarP(&g.quiet, "quiet", "q", false, "print only ids (or nothing) on success")
	root.AddCommand(
		createCmd(g), listCmd(g), getCmd(g), deleteCmd(g), stopCmd(g), resumeCmd(g), extendCmd(g),
		heartbeatCmd(g), delegateCmd(g), delegationsCmd(g), revokeCmd(g), runConfigCmd(g), introspectCmd(g),
		execCmd(g), attachCmd(g), eventsCmd(g), watchCmd(g), sweepCmd(g), limitsCmd(g),
		mcpCmd(g), cpCmd(g), pushCmd(g), diffCmd(g), pullCmd(g), shellCmd(g),
	)
	addCompletions(g, root)
	usage.Guard(root)
	return root
}

// client builds an SDK client from flags, env and the config file, in that order.
func (g *globals) client() (*client.Client, error) {
	path := g.config
	if path == "" {
		path = client.ConfigPath()
	}
	cfg, err := client.LoadConfig(path)
	if err != nil {
		return nil, usage.Errorf("%v", err)
	}
	broker := first(g.broker, os.Getenv("SBX_BROKER_URL"), cfg.Broker, "http://127.0.0.1:7070")
	key := first(g.apiKey, os.Getenv("SBX_API_KEY"), cfg.APIKey)
	if key == "" {
		msg := "no API key: pass --api-key, set SBX_API_KEY, or start a broker on its embedded defaults once to write " + path
		if _, err := os.Stat(path); g.config != "" && errors.Is(err, os.ErrNotExist) {
			// A broker writes the default path (or $SBCTL_CONFIG), never the one given here.
			msg = "no API key: the config file " + path + " (--config) does not exist; pass --api-key or set SBX_API_KEY"
		}
		// Status 0: not the broker's answer, and the message already says where to look.
		return nil, &protocol.Error{Code: protocol.CodeUnauthenticated, Message: msg}
	}
	c, err := client.New(broker, key)
	if err != nil {
		return nil, usage.Errorf("%v", err)
	}
	if u, err := url.Parse(broker); err == nil {
		g.brokerURL = u.Redacted() // a password in the URL stays out of messages
	}
	c.UserAgent = "sbctl"
	return c, nil
}

func first(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// print writes v as JSON or YAML, or calls table for the table format.
func (g *globals) print(v any, table func(w io.Writer)) error {
	switch g.output {
	case "json":
		enc := json.NewEncoder(g.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	case "yaml":
		b, err := yaml.Marshal(v)
		if err != nil {
			return err
		}
		_, err = g.stdout.Write(b)
		return err
	}
	safeTable(g.stdout, table)
	return nil
}

// exitCodeOf classifies an error for scripts.
func exitCodeOf(err error) int {
	var pe *protocol.Error
	var un *client.UnreachableError
	switch {
	case usage.Is(err):
		return exitUsage
	case errors.As(err, &un):
		return exitUnreachable
	case errors.As(err, &pe):
		if limitedCodes[pe.Code] {
			return exitLimited
		}
		switch pe.Code {
		case protocol.CodeNotFound:
			return exitNotFound
		case protocol.CodeUnauthenticated, protocol.CodeForbidden, protocol.CodeDelegateForbidden,
			protocol.CodeScopeDenied, protocol.CodeCommandNotAllowed: // what the credential does not allow
			return exitAuth
		}
		if strings.HasPrefix(pe.Code, "token_") { // a token refused: malformed, expired, revoked, another sandbox's
			return exitAuth
		}
		switch pe.Code {
		case protocol.CodeNameConflict, protocol.CodeInvalidState, protocol.CodeSandboxFailed, protocol.CodeNotRunning,
			protocol.CodeWrongNode: // a 409 like the others: the sandbox is in a state (elsewhere) that refuses this
			return exitConflict
		case protocol.CodeUnreachable, protocol.CodeUnavailable: // the dataplane, or a broker that says retry
			return exitUnreachable
		}
		// A REST 400 is the caller's mistake. The dataplane's refusals carry no HTTP status and may
		// depend on the sandbox (a link leading out, a missing cwd or program): 1. The paths a
		// command line gives are checked against the path rules before they are sent
		// (checkSandboxPath), so a path wrong whatever the sandbox holds exits 2 there.
		if pe.Status == 400 {
			return exitUsage
		}
	}
	return exitError
}

// describe turns an error into one line that says what to do.
func describe(err error) string {
	var pe *protocol.Error
	if errors.As(err, &pe) {
		msg := pe.Message
		if pe.Code == protocol.CodeUnauthenticated && pe.Status == 401 {
			msg += " (check --api-key, SBX_API_KEY or the config file)"
		}
		if pe.RequestID != "" {
			msg += " [request " + pe.RequestID + "]"
		}
		return msg
	}
	return err.Error()
}

// isTerminal says whether r is a terminal. A character device is not enough: /dev/null is one.
func isTerminal(r any) bool {
	f, ok := r.(*os.File)
	if !ok {
		return false
	}
	return term.IsTerminal(int(f.Fd()))
}

// annOutputs is the annotation of a command that prints only some of the -o formats: the formats,
// comma-separated, then ":" and why, for the error.
const annOutputs = "sbctl/outputs"

// outputs restricts the -o formats cmd accepts, so that an unsupported one is an error instead of
// being ignored.
func outputs(cmd *cobra.Command, why string, formats ...string) *cobra.Command {
	if cmd.Annotations == nil {
		cmd.Annotations = map[string]string{}
	}
	cmd.Annotations[annOutputs] = strings.Join(formats, ",") + ":" + why
	return cmd
}

func outputAllowed(cmd *cobra.Command, format string) (bool, string) {
	ann, ok := cmd.Annotations[annOutputs]
	if !ok {
		return true, ""
	}
	formats, why, _ := strings.Cut(ann, ":")
	return slices.Contains(strings.Split(formats, ","), format), why
}
