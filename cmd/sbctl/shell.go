package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/muesli/cancelreader"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/protocol"
)

// sbctl shell: an interactive program on a terminal inside the sandbox (the dataplane's shell op).
// The local terminal goes raw for the session, so every key (^C, ^Z, ^D, arrows) travels as bytes
// and the sandbox's terminal acts on it; it is restored however the session ends.

func shellCmd(g *globals) *cobra.Command {
	var cwd string
	var env []string
	cmd := outputs(&cobra.Command{
		Use:   "shell REF [-- CMD [ARGS...]]",
		Short: "An interactive shell in a sandbox, on a terminal inside it",
		Long: `Open an interactive shell in a running sandbox: the sandbox user's login shell (bash, or /bin/sh
where the sandbox has no bash), or the program given after --, on a terminal allocated inside the
sandbox. Keys go to it as typed: ^C interrupts and ^Z stops the job running in it, as on a local
terminal; the window follows this terminal's size. sbctl exits with the shell's exit code (128+n
when signal n ended it). The shell's session ends with it: jobs it left in the background go too
(start what must outlive it with setsid). While the shell runs, sbctl renews the sandbox's lease
every third of its TTL, as sbctl attach does.

sbctl shell needs a terminal: with standard input not a terminal it refuses (exit 2); run commands
from scripts with sbctl exec. It uses the owner's API key; an agent holding a delegation token with
the exec scope opens the same shell through the dataplane (docs/dataplane.md, "shell").`,
		Example: `  sbctl shell dev
  sbctl shell dev -- python3
  sbctl shell dev --cwd /workspace/app --env DEBUG=1 -- bash -l`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 1 {
				return usage.Errorf("shell takes REF, then optionally -- and a program; see sbctl shell --help")
			}
			if cmd.ArgsLenAtDash() > 1 || (cmd.ArgsLenAtDash() < 0 && len(args) > 1) {
				return usage.Errorf("shell takes one REF; give a program after --, e.g. sbctl shell %s -- python3", args[0])
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkCwd(cwd); err != nil {
				return err
			}
			a := protocol.ShellArgs{Argv: args[1:], Cwd: cwd}
			if len(env) > 0 {
				a.Env = map[string]string{}
				for _, kv := range env {
					k, v, ok := strings.Cut(kv, "=")
					if !ok {
						return usage.Errorf("--env %q is not NAME=value", kv)
					}
					a.Env[k] = v
				}
			}
			in, ok := g.stdin.(*os.File)
			if !ok || !term.IsTerminal(int(in.Fd())) {
				return usage.Errorf("sbctl shell needs a terminal, and its standard input is not one; run commands from scripts with sbctl exec %s -- CMD", args[0])
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := runShell(cmd.Context(), c, args[0], a, in, g.stdout)
			if err != nil {
				return err
			}
			if res.Reason == protocol.ExecReasonMemoryLimit {
				fmt.Fprintf(g.stderr, "sbctl: the shell was killed by the sandbox's memory limit\n")
			}
			if res.ExitCode != 0 {
				return commandExit{res.ExitCode}
			}
			return nil
		},
	}, "it is an interactive terminal", "table")
	cmd.Flags().StringVar(&cwd, "cwd", "", "working directory, an existing directory under /workspace, absolute or relative to it (default /workspace)")
	cmd.Flags().StringArrayVar(&env, "env", nil, "environment variable NAME=value (repeatable)")
	return cmd
}

// runShell runs one shell session on the terminal in (raw for the session, restored before it
// returns) with output to out, and answers how the shell ended.
func runShell(ctx context.Context, c *client.Client, ref string, a protocol.ShellArgs, in *os.File, out io.Writer) (protocol.ExecResult, error) {
	fd := int(in.Fd())
	if cols, rows, err := term.GetSize(fd); err == nil && rows > 0 && cols > 0 {
		a.Rows, a.Cols = min(rows, protocol.ShellMaxWindow), min(cols, protocol.ShellMaxWindow)
	}
	if t := os.Getenv("TERM"); t != "" && protocol.ValidateShell(protocol.ShellArgs{Term: t}) == nil {
		a.Term = t
	}
	sb, err := c.GetSandbox(ctx, ref)
	if err != nil {
		return protocol.ExecResult{}, err
	}
	// The sandbox's own broker: another one answers wrong_node.
	dp := sb.DataplaneURL
	if dp == "" {
		dp = c.DataplaneURL(sb.ID)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: dp, Credential: c.APIKey(), Reconnects: 1})
	if err != nil {
		return protocol.ExecResult{}, err
	}
	defer r.Close()
	state, err := term.MakeRaw(fd)
	if err != nil {
		return protocol.ExecResult{}, fmt.Errorf("put the terminal in raw mode: %w", err)
	}
	defer term.Restore(fd, state)
	sh, err := r.Shell(ctx, backend.ShellRequest{ShellArgs: a, Output: out})
	if err != nil {
		return protocol.ExecResult{}, err
	}
	// Keys are read through a reader that can be cancelled: a read left blocked on the terminal
	// after the session would eat the next key meant for whatever runs next (sbctl watch).
	keys, err := cancelreader.NewReader(in)
	if err != nil {
		return protocol.ExecResult{}, err
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if _, err := io.Copy(sh, keys); err == nil {
			sh.CloseInput() // the terminal itself was closed
		}
	}()
	// A person at the shell is the owner at work: the lease is renewed while the session lasts, as
	// sbctl attach does (only owner calls renew it, not dataplane traffic).
	go keepLease(ctx, c, sb, sh.Done())
	stopResize := watchResize(func() {
		if cols, rows, err := term.GetSize(fd); err == nil {
			sh.Resize(min(max(rows, 1), protocol.ShellMaxWindow), min(max(cols, 1), protocol.ShellMaxWindow))
		}
	})
	go func() {
		defer wg.Done()
		<-sh.Done()
		keys.Cancel()
	}()
	res, err := sh.Wait()
	stopResize()
	wg.Wait()
	keys.Close()
	if err != nil && ctx.Err() != nil {
		return res, ctx.Err()
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		return res, fmt.Errorf("the shell ended: %w", err)
	}
	return res, err
}

// keepLease heartbeats sb every third of its TTL until done. A failed beat is not the session's
// business: if the sandbox stops, the session ends and says so.
func keepLease(ctx context.Context, c *client.Client, sb protocol.Sandbox, done <-chan struct{}) {
	every := max(time.Duration(sb.TTLSeconds)*time.Second/3, time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-ctx.Done():
			return
		case <-t.C:
			hctx, cancel := context.WithTimeout(ctx, every)
			c.Heartbeat(hctx, sb.ID)
			cancel()
		}
	}
}
