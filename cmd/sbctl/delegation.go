package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/protocol"
)

// grantFlags are the flags that describe a delegation, shared by delegate and run-config.
type grantFlags struct {
	scopes   []string
	allowCmd []string
	expires  time.Duration
}

func (f *grantFlags) register(cmd *cobra.Command, defaultScopes []string) {
	cmd.Flags().StringSliceVar(&f.scopes, "scope", defaultScopes, "what the token allows: fs:read, fs:write, exec (comma-separated)")
	cmd.Flags().StringSliceVar(&f.allowCmd, "allow-cmd", nil, "only these programs may be run (comma-separated); commands must then be simple (no ; | && $() redirections)")
	cmd.Flags().Var(client.Duration{D: &f.expires}, "expires", "token lifetime, e.g. 15m or 1d (default: the broker's, 1h)")
}

func (f *grantFlags) request(cmd *cobra.Command) (protocol.MintRequest, error) {
	if err := f.checkAllowCmd(cmd); err != nil {
		return protocol.MintRequest{}, err
	}
	secs, err := secondsFlag(cmd, "expires", f.expires)
	return protocol.MintRequest{Scopes: f.scopes, AllowCmd: f.allowCmd, TTLSeconds: secs}, err
}

// checkAllowCmd refuses --allow-cmd given empty: the request would drop the empty list (the broker
// refuses one sent) and the token would run every program, the opposite of what was asked.
func (f *grantFlags) checkAllowCmd(cmd *cobra.Command) error {
	if cmd.Flags().Changed("allow-cmd") && len(f.allowCmd) == 0 {
		return usage.Errorf("--allow-cmd names no program: list the programs the token may run (e.g. --allow-cmd pytest,python), or leave the flag out to allow any")
	}
	return nil
}

func delegateCmd(g *globals) *cobra.Command {
	var f grantFlags
	cmd := &cobra.Command{
		Use:   "delegate REF --scope fs:read,fs:write,exec",
		Short: "Mint a delegation token that lends one sandbox to an agent server",
		Long: `Mint a short-lived delegation token for one sandbox: it allows only the given scopes (and, with
--allow-cmd, only the given programs) on that sandbox's dataplane, and nothing on the lifecycle
(no stop, no delete, no other sandbox). Revoke it with sbctl revoke. The token is printed once.`,
		Example: `  sbctl delegate dev --scope fs:read,fs:write,exec --expires 30m
  sbctl delegate dev --scope exec --allow-cmd pytest,python -o json`,
		Args: exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("scope") {
				return usage.Errorf("--scope is required: what the token allows, e.g. --scope fs:read,fs:write,exec")
			}
			req, err := f.request(cmd)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.Delegate(cmd.Context(), args[0], req)
			if err != nil {
				return err
			}
			if g.quiet {
				fmt.Fprintln(g.stdout, res.Token)
				return nil
			}
			return g.print(res, func(w io.Writer) {
				fmt.Fprintf(w, "token %s for sandbox %s, expires %s (in %s):\n\n%s\n",
					termSafe(res.JTI), termSafe(res.Sandbox.SandboxID), res.ExpiresAt.Local().Format(time.RFC3339),
					time.Until(res.ExpiresAt).Round(time.Second), res.Token)
			})
		},
	}
	f.register(cmd, nil)
	return cmd
}

func delegationsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "delegations REF",
		Short: "List a sandbox's unexpired delegation tokens (metadata only)",
		Example: `  sbctl delegations dev
  sbctl delegations dev -o json | jq -r '.[] | select(.revoked | not) | .jti'
  sbctl delegations dev -q          # jtis only, for sbctl revoke dev --jti`,
		Args: exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.ListDelegations(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if g.quiet {
				for _, d := range res.Items {
					fmt.Fprintln(g.stdout, d.JTI)
				}
				return nil
			}
			return g.print(res.Items, func(w io.Writer) {
				tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "JTI\tSCOPES\tALLOW-CMD\tEXPIRES\tSTATE\tISSUED BY")
				for _, d := range res.Items {
					state := "active"
					if d.Revoked {
						state = "revoked"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", termSafe(d.JTI), termSafe(strings.Join(d.Scopes, ",")), orDash(termSafe(strings.Join(d.AllowCmd, ","))),
						"in "+time.Until(d.ExpiresAt).Round(time.Second).String(), state, termSafe(d.IssuedBy))
				}
				tw.Flush()
			})
		},
	}
}

func revokeCmd(g *globals) *cobra.Command {
	var jti string
	var all bool
	cmd := &cobra.Command{
		Use:   "revoke REF (--jti J | --all)",
		Short: "Revoke one delegation token, or all of a sandbox's; open connections close within a second",
		Example: `  sbctl revoke dev --jti 6f1c...
  sbctl revoke dev --all`,
		Args: exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (jti == "") == !all {
				return usage.Errorf("give exactly one of --jti J or --all")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			var res protocol.RevokeResponse
			if all {
				res, err = c.RevokeAll(cmd.Context(), args[0])
			} else {
				res, err = c.Revoke(cmd.Context(), args[0], jti)
			}
			if err != nil {
				return err
			}
			if g.quiet {
				return nil
			}
			return g.print(res, func(w io.Writer) {
				if all {
					fmt.Fprintf(w, "revoked every token of sandbox %s\n", termSafe(res.SandboxID))
				} else {
					fmt.Fprintf(w, "revoked token %s of sandbox %s\n", termSafe(res.JTI), termSafe(res.SandboxID))
				}
			})
		},
	}
	cmd.Flags().StringVar(&jti, "jti", "", "id of the token to revoke (see sbctl delegations REF)")
	cmd.Flags().BoolVar(&all, "all", false, "revoke every token of the sandbox")
	return cmd
}

// runConfigExpires is run-config's default token lifetime: long enough for one agent run, short
// enough that the copy an agent server keeps in thread state (and returns from its thread
// endpoints) soon stops working. A client sends a fresh block with every run.
const runConfigExpires = 30 * time.Minute

func runConfigCmd(g *globals) *cobra.Command {
	var f grantFlags
	var thread, format, template string
	var ttl time.Duration
	cmd := outputs(&cobra.Command{
		Use:   "run-config (REF | --thread T)",
		Short: "Print the run-config block that lends a sandbox to an agent server run",
		Long: `Mint a delegation token and print the run config an agent server run request merges in, so the
run's file and shell tools work in the sandbox:

  {"config":{"configurable":{"sandbox":{"sandbox_id":...,"credential":...,"dataplane_url":...,"mcp_url":...}}}}

mcp_url is the sandbox's MCP endpoint (Streamable HTTP) for agent servers with an MCP client; the
same credential opens it.

With --thread T it first creates or reuses the thread's own sandbox (named from the thread id,
tagged thread_id=T), so one thread keeps one sandbox across runs. Tokens are short-lived (30 minutes
unless --expires says otherwise): agent servers keep the block in thread state, so send a fresh
block with every run.

Formats: config (the whole object, default), block (just the sandbox block), env (shell exports of
SBX_SANDBOX_ID, SBX_SANDBOX_CREDENTIAL, SBX_DATAPLANE_URL and SBX_MCP_URL, for a script that
builds its own run request).`,
		Example: `  sbctl run-config dev
  sbctl run-config --thread "$THREAD_ID" --scope fs:read,fs:write,exec --expires 30m
  eval "$(sbctl run-config dev --format env)"
  curl -d "$(sbctl run-config dev | jq '. + {assistant_id: "agent", input: {...}}')" ...`,
		Args: maxArgs(1, "one REF (or --thread T)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == (thread != "") {
				return usage.Errorf("give either REF or --thread T")
			}
			switch format {
			case "config", "block", "env":
			default:
				return usage.Errorf("--format must be config, block or env")
			}
			req, err := f.request(cmd)
			if err != nil {
				return err
			}
			if req.TTLSeconds == nil {
				secs := int64(runConfigExpires / time.Second)
				req.TTLSeconds = &secs
			}
			ttlSecs, err := secondsFlag(cmd, "ttl", ttl)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			ref := ""
			if len(args) == 1 {
				ref = args[0]
			} else {
				res, err := c.CreateSandbox(cmd.Context(), protocol.CreateSandboxRequest{Name: client.ThreadSandboxName(thread),
					Template: template, Tags: map[string]string{"thread_id": thread}, TTLSeconds: ttlSecs})
				if err != nil {
					return err
				}
				ref = res.Sandbox.ID
				fmt.Fprintf(g.stderr, "%s sandbox %s for thread %s\n", termSafe(res.Outcome), termSafe(res.Sandbox.Name), termSafe(thread))
			}
			res, err := c.Delegate(cmd.Context(), ref, req)
			if err != nil {
				return err
			}
			return printRunConfig(g.stdout, format, res.Sandbox)
		},
	}, "it prints JSON (or shell exports); choose what with --format config|block|env", "table", "json")
	f.register(cmd, []string{protocol.ScopeFSRead, protocol.ScopeFSWrite, protocol.ScopeExec})
	cmd.Flags().Lookup("expires").Usage = "token lifetime, e.g. 15m or 2h (default 30m: one run's worth, since agent servers keep the block in thread state)"
	cmd.Flags().StringVar(&thread, "thread", "", "use the thread's own sandbox (created or reused), tagged thread_id=T")
	cmd.Flags().StringVar(&format, "format", "config", "config (the run-config object), block (the sandbox block) or env (shell exports)")
	cmd.Flags().StringVar(&template, "template", "", "with --thread: template of a new sandbox")
	cmd.Flags().Var(client.Duration{D: &ttl}, "ttl", "with --thread: lease of the sandbox, e.g. 2h or 1d (default: the broker's)")
	return cmd
}

func printRunConfig(w io.Writer, format string, b protocol.SandboxBlock) error {
	switch format {
	case "env":
		fmt.Fprintf(w, "export SBX_SANDBOX_ID=%s\nexport SBX_SANDBOX_CREDENTIAL=%s\nexport SBX_DATAPLANE_URL=%s\n",
			shellQuote(b.SandboxID), shellQuote(b.Credential), shellQuote(b.DataplaneURL))
		if b.MCPURL != "" {
			fmt.Fprintf(w, "export SBX_MCP_URL=%s\n", shellQuote(b.MCPURL))
		}
		return nil
	case "block":
		return json.NewEncoder(w).Encode(b)
	}
	return json.NewEncoder(w).Encode(protocol.NewRunConfig(b))
}

func introspectCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "introspect [TOKEN|-]",
		Short: "Check a delegation token: active or not, which sandbox, org and scopes",
		Long: `Ask the broker whether a delegation token is usable now (what an agent server does before it trusts
a run-config block). A token of another org is reported inactive. Reads the token from stdin when
TOKEN is "-" or absent, so it stays out of shell history.`,
		Example: `  sbctl introspect < token.txt
  sbctl delegate dev --scope exec -q | sbctl introspect -o json
  echo "$TOKEN" | sbctl introspect -`,
		Args: maxArgs(1, "at most one TOKEN (or - for stdin)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			token := ""
			if len(args) == 1 && args[0] != "-" {
				token = args[0]
			} else {
				line, _ := bufio.NewReader(io.LimitReader(g.stdin, 1<<20)).ReadString('\n')
				token = strings.TrimSpace(line)
			}
			if token == "" {
				return usage.Errorf("no token given: pass it as TOKEN, or pipe it in (sbctl introspect - < token.txt); see sbctl introspect --help")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.Introspect(cmd.Context(), token)
			if err != nil {
				return err
			}
			return g.print(res, func(w io.Writer) {
				if !res.Active {
					fmt.Fprintf(w, "inactive %s\n", orDash(termSafe(res.Reason)))
					return
				}
				fmt.Fprintf(w, "active: sandbox %s, org %s, scopes %s, expires %s\n", termSafe(res.SandboxID), termSafe(res.Org),
					termSafe(strings.Join(res.Scopes, ",")), time.Unix(res.Exp, 0).Local().Format(time.RFC3339))
			})
		},
	}
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
