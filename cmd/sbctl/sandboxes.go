package main

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/gitsync"
	"github.com/sbxbroker/broker/protocol"
)

// parseTags reads repeated --tag k=v flags.
func parseTags(flags []string) (map[string]string, error) {
	if len(flags) == 0 {
		return nil, nil
	}
	tags := map[string]string{}
	for _, t := range flags {
		k, v, ok := strings.Cut(t, "=")
		if !ok || k == "" {
			return nil, usage.Errorf("--tag %q is not key=value", t)
		}
		tags[k] = v
	}
	return tags, nil
}

func createCmd(g *globals) *cobra.Command {
	var template string
	var ttl time.Duration
	var tags []string
	var noReuse bool
	var isolation string
	var from string
	cmd := &cobra.Command{
		Use:   "create [NAME]",
		Short: "Create a sandbox, or reuse (and resume) the one with this name",
		Long: `Create a sandbox, or reuse the sandbox with this name: a running one is reused as is (its lease
renewed), a stopped one is resumed with its files. The answer says which: created, reused or resumed.
Without NAME a random name is chosen.

The sandbox is stopped (files kept) when nothing heartbeats it for --ttl; keep it alive with
sbctl attach or sbctl heartbeat.

--isolation gvisor runs the sandbox under gVisor (runsc): its commands meet gVisor's kernel, not
the host's. It may raise the template's level, never lower it; a level the broker's host cannot
give is refused (isolation_unavailable), never replaced by a weaker one.

A sandbox the broker cannot isolate (its dir provider) comes with a warning on stderr; the answer's
"isolation" field says "namespace", "gvisor" or "none".

--from DIR pushes the git repository at DIR into the new sandbox's /workspace, as sbctl push does
(see sbctl push --help).`,
		Example: `  sbctl create dev
  sbctl create dev --from .        # create, then push the repository here
  sbctl create dev --ttl 2h --tag thread_id=T42 --tag team=infra
  sbctl create ci-$(date +%s) --no-reuse -o json
  sbctl create review --isolation gvisor`,
		Args: maxArgs(1, "at most one NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			req := protocol.CreateSandboxRequest{Template: template, Isolation: isolation}
			if len(args) == 1 {
				req.Name = args[0]
			} else {
				b := make([]byte, 4)
				rand.Read(b)
				req.Name = "sandbox-" + hex.EncodeToString(b)
			}
			if req.Tags, err = parseTags(tags); err != nil {
				return err
			}
			if req.TTLSeconds, err = secondsFlag(cmd, "ttl", ttl); err != nil {
				return err
			}
			if noReuse {
				f := false
				req.Reuse = &f
			}
			if from != "" { // before anything is created: a wrong DIR changes nothing
				if _, err := gitsync.Open(cmd.Context(), from); err != nil {
					return usage.Errorf("--from: %v", err)
				}
			}
			res, err := c.CreateSandbox(cmd.Context(), req)
			if err != nil {
				return err
			}
			if from != "" {
				return g.createFrom(cmd.Context(), res, from)
			}
			if res.Sandbox.Isolation == protocol.IsolationNone {
				// On stderr, whatever the output format: a script piping -o json still shows it.
				fmt.Fprintf(g.stderr, "sbctl: warning: sandbox %s is not isolated: the broker runs it as a plain directory on its host (the dir provider), where its commands see the host's files, processes and network\n", termSafe(res.Sandbox.Name))
			}
			if g.quiet {
				fmt.Fprintln(g.stdout, res.Sandbox.ID)
				return nil
			}
			return g.print(res, func(w io.Writer) {
				fmt.Fprintf(w, "%s sandbox %s (%s), %s\n", termSafe(res.Outcome), termSafe(res.Sandbox.Name), termSafe(res.Sandbox.ID), statusLine(res.Sandbox))
			})
		},
	}
	cmd.Flags().StringVar(&template, "template", "", "template to create from (default: the broker's \"default\")")
	cmd.Flags().StringVar(&isolation, "isolation", "", "isolation level: namespace or gvisor (default: the template's)")
	cmd.Flags().Var(client.Duration{D: &ttl}, "ttl", "lease: stop the sandbox when nothing heartbeats it this long, e.g. 2h or 1d (default: the broker's, 30m)")
	cmd.Flags().StringArrayVar(&tags, "tag", nil, "tag key=value (repeatable)")
	cmd.Flags().BoolVar(&noReuse, "no-reuse", false, "fail with a conflict if the name is taken instead of reusing it")
	cmd.Flags().StringVar(&from, "from", "", "then push the git repository at this directory into the sandbox (sbctl push)")
	return cmd
}

func listCmd(g *globals) *cobra.Command {
	var tags, statuses []string
	var limit int
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List sandboxes, optionally filtered by tag and status",
		Example: `  sbctl list
  sbctl list --tag thread_id=T42 --status running
  sbctl list -o json | jq -r '.[].id'`,
		Args: maxArgs(0, "no arguments (filter with --tag and --status)"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			o := client.ListOptions{Statuses: statuses}
			if o.Tags, err = parseTags(tags); err != nil {
				return err
			}
			all, err := c.ListAllSandboxes(cmd.Context(), o)
			if err != nil {
				return err
			}
			if limit > 0 && len(all) > limit {
				all = all[:limit]
			}
			if all == nil {
				all = []protocol.Sandbox{}
			}
			if g.quiet {
				for _, s := range all {
					fmt.Fprintln(g.stdout, s.ID)
				}
				return nil
			}
			return g.print(all, func(w io.Writer) { sandboxTable(w, all) })
		},
	}
	cmd.Flags().StringArrayVar(&tags, "tag", nil, "only sandboxes with tag key=value (repeatable: all must match)")
	cmd.Flags().StringArrayVar(&statuses, "status", nil, "only sandboxes in this status: provisioning, running, stopped, failed, deleting (repeatable)")
	cmd.Flags().IntVar(&limit, "limit", 0, "show at most this many (0 = all)")
	return cmd
}

func sandboxTable(w io.Writer, all []protocol.Sandbox) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tID\tSTATUS\tTEMPLATE\tTTL\tEXPIRES\tAGE\tTAGS")
	for _, s := range all {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", termSafe(s.Name), termSafe(s.ID), statusWord(s), termSafe(s.Template),
			time.Duration(s.TTLSeconds)*time.Second, expiresIn(s), ago(s.CreatedAt), tagString(s.Tags))
	}
	tw.Flush()
}

func statusWord(s protocol.Sandbox) string {
	w := s.Status
	if s.StopReason != "" && s.Status == protocol.StatusStopped {
		w += " (" + s.StopReason + ")"
	}
	if s.NodeStatus == protocol.NodeLost {
		w += ", broker lost"
	}
	return termSafe(w)
}

func statusLine(s protocol.Sandbox) string {
	line := statusWord(s)
	if s.ExpiresAt != nil {
		line += ", lease expires " + expiresIn(s)
	}
	if s.Failure != "" {
		line += ": " + termSafe(s.Failure)
	}
	return line
}

func expiresIn(s protocol.Sandbox) string {
	if s.ExpiresAt == nil {
		return "-"
	}
	d := time.Until(*s.ExpiresAt).Round(time.Second)
	if d <= 0 {
		return "now"
	}
	return "in " + d.String()
}

func ago(t time.Time) string {
	d := time.Since(t)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func tagString(tags map[string]string) string {
	if len(tags) == 0 {
		return "-"
	}
	parts := make([]string, 0, len(tags))
	for k, v := range tags {
		parts = append(parts, termSafe(k+"="+v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func getCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "get REF",
		Short:   "Show one sandbox",
		Example: "  sbctl get dev\n  sbctl get sb_0f9c... -o yaml\n  id=$(sbctl get dev -q)",
		Args:    exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			s, err := c.GetSandbox(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if g.quiet {
				fmt.Fprintln(g.stdout, s.ID)
				return nil
			}
			return g.print(s, func(w io.Writer) { describeSandbox(w, s) })
		},
	}
}

func describeSandbox(w io.Writer, s protocol.Sandbox) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, termSafe(v)) }
	row("Name", s.Name)
	row("ID", s.ID)
	row("Status", statusWord(s))
	row("Template", s.Template)
	isolation := s.Isolation
	if s.Isolation == protocol.IsolationNone {
		isolation += " (a plain directory on the broker's host: its commands see the host)"
	}
	row("Provider", s.Provider)
	row("Isolation", isolation)
	if p := s.Placement; p != nil {
		row("Placement", "node "+p.Node+", pod "+p.Pod)
	}
	row("Workspace", s.Workspace)
	row("TTL", (time.Duration(s.TTLSeconds) * time.Second).String())
	row("Expires", expiresIn(s))
	row("Last heartbeat", s.LastHeartbeatAt.Format(time.RFC3339))
	row("Created", s.CreatedAt.Format(time.RFC3339)+" by "+s.CreatedBy)
	row("Tags", tagString(s.Tags))
	if s.Failure != "" {
		row("Failure", s.Failure)
	}
	if s.ProcessesLostAt != nil {
		row("Processes lost", s.ProcessesLostAt.Format(time.RFC3339)+" (broker restart)")
	}
	if s.NodeStatus == protocol.NodeLost && s.NodeLostAt != nil {
		row("Broker lost", s.NodeLostAt.Format(time.RFC3339)+" (the broker hosting it stopped answering; its files are only on that host, out of reach until it is back)")
	}
	tw.Flush()
}

// lifecycleCmd builds stop and resume, which differ only in the call.
func lifecycleCmd(g *globals, use, short, verb, example string, call func(*client.Client, *cobra.Command, string) (protocol.Sandbox, error)) *cobra.Command {
	return &cobra.Command{
		Use:     use + " REF",
		Short:   short,
		Example: example,
		Args:    exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			s, err := call(c, cmd, args[0])
			if err != nil {
				return err
			}
			if g.quiet {
				return nil
			}
			return g.print(s, func(w io.Writer) { fmt.Fprintf(w, "%s sandbox %s: %s\n", verb, termSafe(s.Name), statusLine(s)) })
		},
	}
}

func stopCmd(g *globals) *cobra.Command {
	return lifecycleCmd(g, "stop", "Stop a sandbox: every process ends, files stay", "stopped",
		"  sbctl stop dev\n  sbctl list --tag thread_id=T42 -q | xargs -n1 sbctl stop -q",
		func(c *client.Client, cmd *cobra.Command, ref string) (protocol.Sandbox, error) {
			return c.StopSandbox(cmd.Context(), ref)
		})
}

func resumeCmd(g *globals) *cobra.Command {
	return lifecycleCmd(g, "resume", "Resume a stopped sandbox on the same files (processes start fresh)", "resumed",
		"  sbctl resume dev\n  sbctl resume dev -o json | jq -r .expires_at",
		func(c *client.Client, cmd *cobra.Command, ref string) (protocol.Sandbox, error) {
			return c.ResumeSandbox(cmd.Context(), ref)
		})
}

func deleteCmd(g *globals) *cobra.Command {
	var tags []string
	var dryRun, yes bool
	cmd := &cobra.Command{
		Use:   "delete (REF | --tag k=v...)",
		Short: "Delete a sandbox with its files, or every sandbox matching tags",
		Long: `Delete one sandbox (its processes, files and record), or every sandbox carrying all the given
tags. A batch delete shows what it would delete and asks for confirmation unless --yes; --dry-run
only shows. Delegation tokens for a deleted sandbox stop working at once.`,
		Example: `  sbctl delete dev
  sbctl delete --tag thread_id=T42 --dry-run
  sbctl delete --tag ci=true --yes`,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			sel, err := parseTags(tags)
			if err != nil {
				return err
			}
			switch {
			case len(args) == 1 && len(sel) == 0:
				if dryRun {
					s, err := c.GetSandbox(cmd.Context(), args[0])
					if err != nil {
						return err
					}
					return g.printDeleted(protocol.DeleteSandboxesResponse{DryRun: true, Deleted: []protocol.Sandbox{s}})
				}
				res, err := c.DeleteSandbox(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				return g.printDeleted(res)
			case len(args) == 0 && len(sel) > 0:
			default:
				return usage.Errorf("give a REF, or at least one --tag k=v (not both); see sbctl delete --help")
			}
			preview, err := c.DeleteSandboxes(cmd.Context(), sel, true)
			if err != nil {
				return err
			}
			if dryRun || len(preview.Deleted) == 0 {
				return g.printDeleted(preview)
			}
			if !yes {
				if !g.isTTY {
					return usage.Errorf("refusing to delete %s without --yes (stdin is not a terminal)", count(len(preview.Deleted), "sandbox", "sandboxes"))
				}
				sandboxTable(g.stderr, preview.Deleted)
				if len(preview.Deleted) == 1 {
					fmt.Fprint(g.stderr, "Delete this sandbox and its files? [y/N] ")
				} else {
					fmt.Fprintf(g.stderr, "Delete these %d sandboxes and their files? [y/N] ", len(preview.Deleted))
				}
				answer, _ := bufio.NewReader(g.stdin).ReadString('\n')
				if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
					return fmt.Errorf("nothing deleted")
				}
			}
			res, err := c.DeleteSandboxes(cmd.Context(), sel, false)
			if err != nil {
				return err
			}
			return g.printDeleted(res)
		},
	}
	cmd.Flags().StringArrayVar(&tags, "tag", nil, "delete every sandbox with tag key=value (repeatable: all must match)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only show what would be deleted")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}

func (g *globals) printDeleted(res protocol.DeleteSandboxesResponse) error {
	if g.quiet {
		for _, s := range res.Deleted {
			fmt.Fprintln(g.stdout, s.ID)
		}
		return nil
	}
	return g.print(res, func(w io.Writer) {
		verb := "deleted"
		if res.DryRun {
			verb = "would delete"
		}
		if len(res.Deleted) == 0 {
			fmt.Fprintln(w, "no sandbox matches")
		}
		for _, s := range res.Deleted {
			fmt.Fprintf(w, "%s %s (%s)\n", verb, termSafe(s.Name), termSafe(s.ID))
		}
	})
}

func extendCmd(g *globals) *cobra.Command {
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:     "extend REF --ttl D",
		Short:   "Change a sandbox's lease length; a running sandbox's lease restarts now",
		Example: "  sbctl extend dev --ttl 4h",
		Args:    exactArgs(1, "REF (a sandbox id or name)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("ttl") {
				return usage.Errorf("--ttl is required, e.g. --ttl 2h")
			}
			if _, err := secondsFlag(cmd, "ttl", ttl); err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			l, err := c.SetTTL(cmd.Context(), args[0], ttl)
			if err != nil {
				return err
			}
			return g.printLease(args[0], l)
		},
	}
	cmd.Flags().Var(client.Duration{D: &ttl}, "ttl", "new lease length, e.g. 45m, 4h or 2d")
	return cmd
}

func heartbeatCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "heartbeat REF...",
		Short: "Renew running sandboxes' leases once (sbctl attach keeps renewing them)",
		Example: `  sbctl heartbeat dev
  sbctl heartbeat $(sbctl list --tag team=infra -q)   # many leases, one request`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usage.Errorf("heartbeat takes one or more REFs (sandbox ids or names)")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if len(args) == 1 {
				l, err := c.Heartbeat(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				return g.printLease(args[0], l)
			}
			res, err := c.Heartbeats(cmd.Context(), args)
			if err != nil {
				return err
			}
			var failed error
			for _, it := range res.Items {
				if it.Error != nil {
					fmt.Fprintf(g.stderr, "sbctl: %s: %s\n", termSafe(it.Ref), termSafe(it.Error.Message))
					failed = it.Error
					continue
				}
				if err := g.printLease(it.Ref, *it.Lease); err != nil {
					return err
				}
			}
			if failed != nil {
				return silent{failed}
			}
			return nil
		},
	}
}

// silent is an error already reported on stderr: it only sets the exit code.
type silent struct{ error }

func (s silent) Unwrap() error { return s.error }

func (g *globals) printLease(ref string, l protocol.HeartbeatResponse) error {
	if g.quiet {
		return nil
	}
	return g.print(l, func(w io.Writer) {
		if l.ExpiresAt == nil {
			fmt.Fprintf(w, "%s: %s, ttl %s\n", termSafe(ref), termSafe(l.Status), time.Duration(l.TTLSeconds)*time.Second)
			return
		}
		fmt.Fprintf(w, "%s: %s, lease expires in %s (%s)\n", termSafe(ref), termSafe(l.Status),
			time.Until(*l.ExpiresAt).Round(time.Second), l.ExpiresAt.Local().Format(time.TimeOnly))
	})
}

// exactArgs is cobra.ExactArgs with a message that names what is missing, and a usage error's
// exit code.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usage.Errorf("%s takes %s; see %s --help", cmd.Name(), what, cmd.CommandPath())
		}
		return nil
	}
}

// maxArgs is cobra.MaximumNArgs (and, with 0, cobra.NoArgs) the same way.
func maxArgs(n int, what string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) > n {
			return usage.Errorf("%s takes %s, not %q; see %s --help", cmd.Name(), what, strings.Join(args, " "), cmd.CommandPath())
		}
		return nil
	}
}

// secondsFlag is the duration flag's value for the API, which counts leases and token lifetimes in
// whole seconds (less than one would silently become 0), or nil when the flag was not given.
func secondsFlag(cmd *cobra.Command, flag string, d time.Duration) (*int64, error) {
	if !cmd.Flags().Changed(flag) {
		return nil, nil
	}
	if d < time.Second {
		return nil, usage.Errorf("--%s %s is less than a second: leases and tokens are counted in whole seconds; use e.g. 90s, 30m, 2h or 7d", flag, d)
	}
	secs := int64(d / time.Second)
	return &secs, nil
}
