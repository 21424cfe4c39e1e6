package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/mcp"
	"github.com/sbxbroker/broker/protocol"
)

func mcpCmd(g *globals) *cobra.Command {
	var f grantFlags
	cmd := &cobra.Command{
		Use:   "mcp REF [--scope ...] [--allow-cmd ...] [--expires D]",
		Short: "Serve a sandbox's tools to a local MCP client (stdio)",
		Long: `Serve one sandbox's tools over MCP on stdin/stdout, for a local MCP client (Claude Code, Cursor,
VS Code, any client that starts a stdio server). The tools (read_file, write_file, edit_file, ls,
glob, grep, execute) run through the sandbox's dataplane with a delegation token this command mints
with the given scopes and allowlist: tools the scopes do not allow are not listed, commands
outside --allow-cmd are refused, and every call shows in the sandbox's events under the token's
jti. The token is renewed before it expires while the server runs and revoked when it exits.

Nothing but MCP is written to stdout; messages go to stderr. If the owner revokes the token or the
sandbox stops, the server says why on stderr and exits.

Agent servers reach the same tools over Streamable HTTP at the mcp_url of a run-config block.
sbctl mcp config REF --client C prints the snippet that makes a client start this command.`,
		Example: `  sbctl mcp dev
  sbctl mcp dev --scope fs:read,exec --allow-cmd pytest,python
  sbctl mcp config dev --client claude-code`,
		Args: exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req, err := f.request(cmd)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			return serveMCP(cmd.Context(), g, c, args[0], req)
		},
	}
	// Persistent, so that mcp config takes the same flags and writes them into the snippet.
	pf := cmd.PersistentFlags()
	pf.StringSliceVar(&f.scopes, "scope", []string{protocol.ScopeFSRead, protocol.ScopeFSWrite, protocol.ScopeExec}, "what the token allows: fs:read, fs:write, exec (comma-separated)")
	pf.StringSliceVar(&f.allowCmd, "allow-cmd", nil, "only these programs may be run (comma-separated); commands must then be simple (no ; | && $() redirections)")
	pf.Var(client.Duration{D: &f.expires}, "expires", "token lifetime, e.g. 15m or 1d (default: the broker's, 1h); renewed before it ends")
	cmd.AddCommand(mcpConfigCmd(g, &f))
	return cmd
}

// serveMCP runs the stdio server until stdin ends, the context is cancelled, or the broker ends the
// token's dataplane connection (revoked, sandbox stopped).
func serveMCP(ctx context.Context, g *globals, c *client.Client, ref string, req protocol.MintRequest) error {
	dp := &renewingDataplane{c: c, ref: ref, req: req, stderr: g.stderr}
	if err := dp.start(ctx); err != nil {
		return err
	}
	srv := mcp.NewServer(dp, mcp.Options{Scopes: dp.scopes, AllowCmd: req.AllowCmd})
	runCtx, cancel := context.WithCancelCause(ctx)
	renewed := make(chan struct{})
	// Renewal ends before the last token is revoked, so that none it mints outlives the server.
	defer func() {
		cancel(nil)
		<-renewed
		dp.stop()
	}()
	go func() {
		select {
		case <-dp.ended:
			cancel(dp.endErr)
		case <-runCtx.Done():
		}
	}()
	go func() {
		defer close(renewed)
		dp.renew(runCtx)
	}()
	err := srv.Run(runCtx, mcp.StdioTransport(g.stdin, g.stdout))
	if cause := context.Cause(runCtx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	if ctx.Err() != nil || err == nil || errors.Is(err, io.EOF) || errors.Is(err, context.Canceled) {
		return nil
	}
	if strings.Contains(err.Error(), "EOF") || strings.Contains(err.Error(), "closed") {
		return nil // the client closed stdin: its normal way to end the server
	}
	return err
}

// renewingDataplane is the dataplane of sbctl mcp: a token it minted, replaced by a fresh one before
// it expires (calls in flight finish on the old connection, which is then closed and its token
// revoked), and revoked when the server stops.
type renewingDataplane struct {
	c      *client.Client
	ref    string
	req    protocol.MintRequest
	stderr io.Writer
	scopes []string

	mu  sync.Mutex
	cur *lease

	ended   chan struct{}
	endOnce sync.Once
	endErr  error
}

// lease is one token and its connection; inflight counts the calls using it.
type lease struct {
	jti      string
	sandbox  string
	expires  time.Time
	lifetime time.Duration
	remote   *backend.Remote
	inflight sync.WaitGroup
	// closed is closed when this side closes the lease's connection (renewed, or the server stops).
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *lease) close() {
	l.closeOnce.Do(func() {
		close(l.closed)
		l.remote.Close()
	})
}

func (d *renewingDataplane) start(ctx context.Context) error {
	d.ended = make(chan struct{})
	l, err := d.mint(ctx)
	if err != nil {
		return err
	}
	d.cur = l
	d.scopes = l.remote.Hello().Scopes
	go d.watch(l)
	fmt.Fprintf(d.stderr, "sbctl mcp: serving sandbox %s over stdio with token %s (scopes %s), renewed before it expires\n",
		termSafe(l.sandbox), termSafe(l.jti), strings.Join(d.scopes, ","))
	return nil
}

func (d *renewingDataplane) mint(ctx context.Context) (*lease, error) {
	issued := time.Now()
	res, err := d.c.Delegate(ctx, d.ref, d.req)
	if err != nil {
		return nil, err
	}
	r, err := backend.Dial(ctx, backend.Config{URL: res.Sandbox.DataplaneURL, Credential: res.Token, SandboxID: res.Sandbox.SandboxID})
	if err != nil {
		d.revoke(res.Sandbox.SandboxID, res.JTI)
		return nil, err
	}
	return &lease{jti: res.JTI, sandbox: res.Sandbox.SandboxID, expires: res.ExpiresAt, lifetime: res.ExpiresAt.Sub(issued), remote: r,
		closed: make(chan struct{})}, nil
}

// watch ends the server when the broker ends the current lease's connection for good.
func (d *renewingDataplane) watch(l *lease) {
	select {
	case <-l.remote.Ended():
	case <-l.closed:
		return
	}
	d.mu.Lock()
	current := d.cur == l
	d.mu.Unlock()
	if current {
		e := l.remote.EndedErr()
		d.endOnce.Do(func() {
			d.endErr = fmt.Errorf("the MCP session ended: %s (%s)", e.Message, e.Code)
			close(d.ended)
		})
	}
}

// renew replaces the lease when two thirds of its lifetime have passed.
func (d *renewingDataplane) renew(ctx context.Context) {
	for {
		d.mu.Lock()
		l := d.cur
		d.mu.Unlock()
		wait := time.Until(l.expires) - l.lifetime/3
		select {
		case <-ctx.Done():
			return
		case <-time.After(max(wait, 0)):
		}
		next, err := d.mint(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			fmt.Fprintf(d.stderr, "sbctl mcp: renewing the token failed (%s); retrying\n", termSafe(describe(err)))
			select {
			case <-ctx.Done():
				return
			case <-time.After(min(5*time.Second, max(time.Until(l.expires)/4, 100*time.Millisecond))):
			}
			continue
		}
		d.mu.Lock()
		d.cur = next
		d.mu.Unlock()
		go d.watch(next)
		go func() {
			l.inflight.Wait()
			l.close()
			d.revoke(l.sandbox, l.jti)
		}()
	}
}

func (d *renewingDataplane) revoke(sandbox, jti string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := d.c.Revoke(ctx, sandbox, jti); err != nil {
		fmt.Fprintf(d.stderr, "sbctl mcp: revoking token %s failed (%s): revoke it with sbctl revoke %s --jti %s\n",
			termSafe(jti), termSafe(describe(err)), termSafe(sandbox), termSafe(jti))
	}
}

// stop closes the connection and revokes the current token.
func (d *renewingDataplane) stop() {
	d.mu.Lock()
	l := d.cur
	d.mu.Unlock()
	l.close()
	d.revoke(l.sandbox, l.jti)
}

// Call runs op on the current lease.
func (d *renewingDataplane) Call(ctx context.Context, op string, args any) (json.RawMessage, error) {
	d.mu.Lock()
	l := d.cur
	l.inflight.Add(1)
	d.mu.Unlock()
	defer l.inflight.Done()
	return l.remote.Call(ctx, op, args)
}

// mcpClients are the MCP clients mcp config knows, and where their snippet goes.
var mcpClients = map[string]string{
	"claude-code": "run the command, or put the JSON in .mcp.json at the project's root",
	"cursor":      "put it in .cursor/mcp.json (the project) or ~/.cursor/mcp.json (every project)",
	"vscode":      "put it in .vscode/mcp.json",
}

func mcpConfigCmd(g *globals, f *grantFlags) *cobra.Command {
	var clientName, name string
	cmd := &cobra.Command{
		Use:   "config REF --client claude-code|cursor|vscode",
		Short: "Print the snippet that makes an MCP client start sbctl mcp REF",
		Long: `Print the configuration that makes an MCP client start "sbctl mcp REF" (stdio) with the given
--scope, --allow-cmd and --expires: the JSON on stdout (so it can be redirected into the client's
file), where it goes on stderr. The snippet names this sbctl by its absolute path, and the broker
by its URL when --broker or SBX_BROKER_URL gives one (else the sbctl it starts reads the broker
from its config file, as this one does); it carries no credential (sbctl reads its API key from
SBX_API_KEY or its config file).`,
		Example: `  sbctl mcp config dev --client claude-code
  sbctl mcp config dev --client cursor --scope fs:read,exec --allow-cmd pytest > .cursor/mcp.json`,
		Args: exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			where, ok := mcpClients[clientName]
			if !ok {
				return usage.Errorf("--client must be claude-code, cursor or vscode, not %q; see sbctl mcp config --help", clientName)
			}
			exe, err := os.Executable()
			if err != nil || !filepath.IsAbs(exe) {
				exe = "sbctl"
			}
			broker := g.broker
			if broker == "" {
				broker = os.Getenv("SBX_BROKER_URL")
			}
			mcpArgs := []string{"mcp", args[0]}
			if broker != "" {
				mcpArgs = append(mcpArgs, "--broker", broker)
			}
			if g.config != "" {
				mcpArgs = append(mcpArgs, "--config", g.config)
			}
			if err := f.checkAllowCmd(cmd); err != nil {
				return err
			}
			fl := cmd.Flags()
			if fl.Changed("scope") {
				mcpArgs = append(mcpArgs, "--scope", strings.Join(f.scopes, ","))
			}
			if fl.Changed("allow-cmd") {
				mcpArgs = append(mcpArgs, "--allow-cmd", strings.Join(f.allowCmd, ","))
			}
			if fl.Changed("expires") {
				mcpArgs = append(mcpArgs, "--expires", f.expires.String())
			}
			if name == "" {
				name = "sandbox-" + args[0]
			}
			server := map[string]any{"command": exe, "args": mcpArgs}
			var doc any
			switch clientName {
			case "claude-code":
				fmt.Fprintf(g.stderr, "sbctl: %s; the command is:\n  claude mcp add %s -- %s\n", where, shellQuote(name), shellJoin(append([]string{exe}, mcpArgs...)))
				doc = map[string]any{"mcpServers": map[string]any{name: map[string]any{"type": "stdio", "command": exe, "args": mcpArgs}}}
			case "cursor":
				fmt.Fprintf(g.stderr, "sbctl: %s\n", where)
				doc = map[string]any{"mcpServers": map[string]any{name: server}}
			case "vscode":
				fmt.Fprintf(g.stderr, "sbctl: %s\n", where)
				doc = map[string]any{"servers": map[string]any{name: map[string]any{"type": "stdio", "command": exe, "args": mcpArgs}}}
			}
			enc := json.NewEncoder(g.stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(doc)
		},
	}
	cmd.Flags().StringVar(&clientName, "client", "", "the MCP client: claude-code, cursor or vscode")
	cmd.Flags().StringVar(&name, "name", "", "the server's name in the client (default sandbox-REF)")
	return cmd
}

func shellJoin(words []string) string {
	out := make([]string, len(words))
	for i, w := range words {
		out[i] = shellQuote(w)
	}
	return strings.Join(out, " ")
}
