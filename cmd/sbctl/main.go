// Command sbctl is the sandbox broker's CLI: create, reuse, list and control sandboxes, lend them to
// agent servers, and follow their events.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/sbxbroker/broker/client"
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
)

// globals are the flags every command shares.
type globals struct {
	broker string
	apiKey string
	output string
	config string
	quiet  bool
	stdout io.Writer
	stderr io.Writer
	stdin  io.Reader
	isTTY  bool
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// exitCoder is an error that carries the process exit code (sbctl exec passes the command's through).
type exitCoder interface{ ExitCode() int }

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
	var ec exitCoder
	if errors.As(err, &ec) {
		return ec.ExitCode()
	}
	if _, ok := err.(silent); !ok {
		fmt.Fprintln(stderr, "sbctl:", describe(err))
	}
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

Exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 not authorized, 5 conflict (name taken, sandbox
stopped or failed), 6 broker unreachable; sbctl exec exits with the command's own code.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			switch g.output {
			case "table", "json", "yaml":
				return nil
			}
			return usageErr("-o must be table, json or yaml, not %q", g.output)
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageErr("%v", err) })
	pf := root.PersistentFlags()
	pf.StringVar(&g.broker, "broker", "", "broker URL (env SBX_BROKER_URL; default from the config file, else http://127.0.0.1:7070)")
	pf.StringVar(&g.apiKey, "api-key", "", "org API key (env SBX_API_KEY; default from the config file)")
	pf.StringVarP(&g.output, "output", "o", "table", "output format: table, json or yaml")
	pf.StringVar(&g.config, "config", "", "config file (env SBCTL_CONFIG; default "+client.ConfigPath()+")")
	pf.BoolVarP(&g.quiet, "quiet", "q", false, "print only ids (or nothing) on success")
	root.AddCommand(
		createCmd(g), listCmd(g), getCmd(g), deleteCmd(g), stopCmd(g), resumeCmd(g), extendCmd(g),
		heartbeatCmd(g), delegateCmd(g), delegationsCmd(g), revokeCmd(g), runConfigCmd(g), introspectCmd(g),
		execCmd(g), attachCmd(g), eventsCmd(g), sweepCmd(g),
	)
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
		return nil, usageErr("%v", err)
	}
	broker := first(g.broker, os.Getenv("SBX_BROKER_URL"), cfg.Broker, "http://127.0.0.1:7070")
	key := first(g.apiKey, os.Getenv("SBX_API_KEY"), cfg.APIKey)
	if key == "" {
		return nil, &protocol.Error{Code: protocol.CodeUnauthenticated, Status: 401, Message: "no API key: pass --api-key, set SBX_API_KEY, or start a broker on its embedded defaults once to write " + path}
	}
	c, err := client.New(broker, key)
	if err != nil {
		return nil, usageErr("%v", err)
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
	table(g.stdout)
	return nil
}

type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usageErr(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// exitCodeOf classifies an error for scripts.
func exitCodeOf(err error) int {
	var ue *usageError
	var pe *protocol.Error
	var un *client.UnreachableError
	switch {
	case errors.As(err, &ue):
		return exitUsage
	case errors.As(err, &un):
		return exitUnreachable
	case errors.As(err, &pe):
		switch pe.Code {
		case protocol.CodeNotFound:
			return exitNotFound
		case protocol.CodeUnauthenticated, protocol.CodeForbidden, protocol.CodeDelegateForbidden:
			return exitAuth
		case protocol.CodeNameConflict, protocol.CodeInvalidState, protocol.CodeSandboxFailed, protocol.CodeNotRunning:
			return exitConflict
		}
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

func isTerminal(r any) bool {
	f, ok := r.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
