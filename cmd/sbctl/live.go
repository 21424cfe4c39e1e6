package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/protocol"
)

// commandExit carries a command's exit code out of sbctl exec.
type commandExit struct{ code int }

func (e commandExit) Error() string { return fmt.Sprintf("exit %d", e.code) }
func (e commandExit) ExitCode() int { return e.code }

func execCmd(g *globals) *cobra.Command {
	var shell, cwd string
	var env []string
	var timeout time.Duration
	var stdin bool
	cmd := outputs(&cobra.Command{
		Use:   "exec REF (-- CMD [ARGS...] | -c 'SHELL COMMAND')",
		Short: "Run a command in a sandbox, streaming its output; sbctl exits with the command's code",
		Long: `Run a command in a running sandbox through its dataplane, with the owner's API key. Output streams
as it comes (stdout to stdout, stderr to stderr) and sbctl exits with the command's exit code
(128+n when signal n ended it). The command runs in /workspace unless --cwd says otherwise.

With -i, sbctl's standard input is sent whole with the request: it must be text (UTF-8) and fit in
one dataplane frame (about 1 MiB); put larger or binary input in a workspace file and redirect
from it.`,
		Example: `  sbctl exec dev -- ls -la
  sbctl exec dev -c 'pytest -q && echo green'
  sbctl exec dev --cwd /workspace/app --env DEBUG=1 -- python3 main.py
  echo 'print(2+2)' | sbctl exec dev -i -- python3`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 1 {
				return usage.Errorf("exec takes REF and a command; see sbctl exec --help")
			}
			if shell == "" && len(args) == 1 {
				return usage.Errorf("no command: give one after -- (a program and its arguments) or with -c (a shell string)")
			}
			if shell != "" && len(args) > 1 {
				return usage.Errorf("give the command either after -- (a program and its arguments) or with -c (a shell string), not both")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if timeout < 0 || (timeout > 0 && timeout < time.Millisecond) {
				return usage.Errorf("--timeout %s: give at least 1ms, e.g. 500ms, 30s or 2h (0 is the sandbox's default)", timeout)
			}
			if err := checkCwd(cwd); err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			a := protocol.ExecArgs{Command: shell, Argv: args[1:], Cwd: cwd, TimeoutMS: timeout.Milliseconds()}
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
			// The sandbox's own broker: another one answers wrong_node.
			dp, err := c.SandboxDataplaneURL(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			r, err := backend.Dial(cmd.Context(), backend.Config{URL: dp, Credential: c.APIKey(), Reconnects: 1})
			if err != nil {
				return err
			}
			defer r.Close()
			if stdin {
				if a.Stdin, err = readStdin(g.stdin, r.Hello().Limits.MaxFrameBytes); err != nil {
					return err
				}
			}
			res, err := r.Exec(cmd.Context(), backend.ExecRequest{ExecArgs: a, Stdout: g.stdout, Stderr: g.stderr})
			if err != nil {
				return err
			}
			switch res.Reason {
			case "timeout":
				fmt.Fprintf(g.stderr, "sbctl: the command timed out and was killed\n")
			case "memory_limit":
				fmt.Fprintf(g.stderr, "sbctl: the command was killed by the sandbox's memory limit\n")
			}
			if res.Truncated {
				fmt.Fprintf(g.stderr, "sbctl: output was truncated\n")
			}
			if res.ExitCode != 0 {
				return commandExit{res.ExitCode}
			}
			return nil
		},
	}, "it passes the command's own output through", "table")
	cmd.Flags().StringVarP(&shell, "command", "c", "", "a shell command string, run with /bin/sh -c")
	cmd.Flags().StringVar(&cwd, "cwd", "", "working directory, an existing directory under /workspace, absolute or relative to it (default /workspace)")
	cmd.Flags().StringArrayVar(&env, "env", nil, "environment variable NAME=value (repeatable)")
	cmd.Flags().Var(client.Duration{D: &timeout}, "timeout", "kill the command's process tree after this long, e.g. 30s or 2h (default: the sandbox's, 10m)")
	cmd.Flags().BoolVarP(&stdin, "stdin", "i", false, "send sbctl's standard input (text, up to about 1 MiB) to the command")
	return cmd
}

// readStdin reads exec -i's input, which travels whole in the exec request's one text frame. Too
// much, or bytes that are not UTF-8 (JSON would replace them), is an error rather than a cut or
// altered input.
func readStdin(r io.Reader, maxFrame int) (string, error) {
	if maxFrame <= 0 {
		maxFrame = 1 << 20
	}
	// The rest of the request (command, env, JSON framing) and escaping take some of the frame.
	limit := maxFrame - 64<<10
	b, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return "", fmt.Errorf("read stdin: %w", err)
	}
	if len(b) > limit {
		return "", usage.Errorf("exec -i: stdin is larger than %d bytes, what one exec request carries; write it to a file in the workspace and redirect from it", limit)
	}
	if !utf8.Valid(b) {
		return "", usage.Errorf("exec -i: stdin is not UTF-8 text, which is all an exec request carries; write binary input to a file in the workspace and redirect from it")
	}
	return string(b), nil
}

func attachCmd(g *globals) *cobra.Command {
	var stopOnExit, deleteOnExit bool
	cmd := outputs(&cobra.Command{
		Use:   "attach REF...",
		Short: "Keep sandboxes' leases alive while this runs (a heartbeat every TTL/3)",
		Long: `Heartbeat one or more sandboxes every third of their (shortest) TTL for as long as sbctl attach
runs, in one request per beat, riding out brief broker or network faults, and show the time left.
Ctrl-C ends it cleanly; with --stop-on-exit or --delete-on-exit the sandboxes are stopped or
deleted then. If a sandbox stops meanwhile (its lease expired during a long outage, or someone
stopped it), attach says so and exits with code 5.`,
		Example: "  sbctl attach dev\n  sbctl attach dev --stop-on-exit\n  sbctl attach $(sbctl list --tag thread_id=T42 -q)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usage.Errorf("attach takes one or more REFs (sandbox ids or names)")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, refs []string) error {
			if stopOnExit && deleteOnExit {
				return usage.Errorf("give at most one of --stop-on-exit and --delete-on-exit")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			err = attach(cmd.Context(), g, c, refs)
			if !stopOnExit && !deleteOnExit {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var failed error
			for _, ref := range refs {
				verb, cerr := "stopped", error(nil)
				if deleteOnExit {
					verb = "deleted"
					_, cerr = c.DeleteSandbox(ctx, ref)
				} else {
					_, cerr = c.StopSandbox(ctx, ref)
				}
				if cerr != nil {
					fmt.Fprintf(g.stderr, "sbctl: %s was not %s: %s\n", termSafe(ref), verb, termSafe(describe(cerr)))
					failed = cerr
					continue
				}
				fmt.Fprintf(g.stderr, "%s %s\n", verb, termSafe(ref))
			}
			if err != nil || failed == nil {
				return err
			}
			return silent{failed}
		},
	}, "it shows the leases as status lines on stderr", "table")
	cmd.Flags().BoolVar(&stopOnExit, "stop-on-exit", false, "stop the sandboxes when attach ends")
	cmd.Flags().BoolVar(&deleteOnExit, "delete-on-exit", false, "delete the sandboxes when attach ends")
	return cmd
}

// attach heartbeats refs until ctx ends. Faults are retried with backoff while leases have time left.
func attach(ctx context.Context, g *globals, c *client.Client, refs []string) error {
	var earliest time.Time // the first lease to run out, as of the last good beat
	every := 10 * time.Second
	for failures := 0; ; {
		res, err := c.Heartbeats(ctx, refs)
		var pe *protocol.Error
		switch {
		case ctx.Err() != nil:
			fmt.Fprintln(g.stderr)
			return nil
		case errors.As(err, &pe) && pe.Status > 0 && pe.Status < 500:
			fmt.Fprintln(g.stderr)
			return err // not allowed, malformed: retrying will not help
		case err != nil:
			failures++
			left := "unknown"
			if !earliest.IsZero() {
				left = time.Until(earliest).Round(time.Second).String()
			}
			g.status("heartbeat failed (%s); retrying, the first lease runs out in %s", describe(err), left)
			every = min(time.Second<<min(failures, 4), max(every, time.Second))
		default:
			failures = 0
			var parts []string
			minTTL := time.Duration(0)
			earliest = time.Time{}
			for _, it := range res.Items {
				if it.Error != nil {
					fmt.Fprintln(g.stderr)
					return fmt.Errorf("%s: %w", it.Ref, it.Error) // stopped, deleted: the lease is gone
				}
				ttl := time.Duration(it.Lease.TTLSeconds) * time.Second
				if minTTL == 0 || ttl < minTTL {
					minTTL = ttl
				}
				if it.Lease.ExpiresAt != nil {
					if earliest.IsZero() || it.Lease.ExpiresAt.Before(earliest) {
						earliest = *it.Lease.ExpiresAt
					}
					parts = append(parts, fmt.Sprintf("%s expires in %s", it.Ref, time.Until(*it.Lease.ExpiresAt).Round(time.Second)))
				}
				if it.Lease.NodeStatus == protocol.NodeLost {
					parts = append(parts, it.Ref+"'s broker is lost (its files and processes are out of reach until it is back)")
				}
			}
			every = max(minTTL/3, time.Second)
			g.status("lease renewed at %s: %s (beat every %s; Ctrl-C to detach)", time.Now().Format(time.TimeOnly), strings.Join(parts, ", "), every)
		}
		select {
		case <-ctx.Done():
			fmt.Fprintln(g.stderr)
			return nil
		case <-time.After(every):
		}
	}
}

// status prints a status line: rewritten in place on a terminal, one line each otherwise.
func (g *globals) status(format string, args ...any) {
	line := termSafe(fmt.Sprintf(format, args...))
	if f, ok := g.stderr.(*os.File); ok && isTerminal(f) {
		fmt.Fprintf(g.stderr, "\r\033[K%s", line)
		return
	}
	fmt.Fprintln(g.stderr, line)
}

// errSandboxDeleted ends sbctl events REF at the sandbox's deleted event.
var errSandboxDeleted = errors.New("the sandbox was deleted")

// eventID is an event's stream position, MS-SEQ, the only form the broker resumes after.
var eventID = regexp.MustCompile(`^[0-9]+-[0-9]+$`)

func eventsCmd(g *globals) *cobra.Command {
	var all, follow bool
	var backlog int
	var since string
	cmd := outputs(&cobra.Command{
		Use:   "events (REF | --all) [-f]",
		Short: "Show a sandbox's events (or the whole org's); -f follows them live",
		Long: `Show recent events of a sandbox, or of every sandbox with --all: lifecycle (created, stopped with
its reason, expiring, deleted...), tokens (minted, revoked, by jti) and dataplane activity
(connected, file_written, exec with exit code). With -f it follows new events, and after a dropped
connection resumes exactly where it left off; following one sandbox ends at its deleted event.
-o json prints one JSON object per line.`,
		Example: "  sbctl events dev -f\n  sbctl events --all -f -o json | jq -c 'select(.type==\"exec\")'",
		Args: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == all || len(args) > 1 {
				return usage.Errorf("give a REF, or --all for the whole org (not both); see sbctl events --help")
			}
			if since != "" && !eventID.MatchString(since) {
				return usage.Errorf("--since %q is not an event id: give the id of an event as -o json prints it (e.g. 1795790386522-2)", since)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			o := client.EventOptions{Backlog: backlog, Follow: follow, After: since}
			if len(args) == 1 {
				o.Ref = args[0]
			}
			o.OnReconnect = func(err error, attempt int) {
				if attempt == 1 || attempt%10 == 0 {
					fmt.Fprintf(g.stderr, "sbctl: event stream dropped (%s); reconnecting\n", termSafe(err.Error()))
				}
			}
			enc := json.NewEncoder(g.stdout)
			tw := tabwriter.NewWriter(termWriter{g.stdout}, 0, 4, 1, ' ', 0)
			err = c.Events(cmd.Context(), o, func(e protocol.Event) error {
				if g.output == "json" {
					err = enc.Encode(e)
				} else {
					fmt.Fprintln(tw, eventLine(e, all))
					err = tw.Flush()
				}
				if err == nil && o.Ref != "" && e.Type == protocol.EventDeleted {
					return errSandboxDeleted // nothing can follow a sandbox's deleted event
				}
				return err
			})
			if errors.Is(err, errSandboxDeleted) {
				if follow {
					fmt.Fprintf(g.stderr, "sbctl: sandbox %s was deleted: no more events will come\n", termSafe(o.Ref))
				}
				return nil
			}
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		},
	}, "it streams events as table lines or, with -o json, one JSON object per line", "table", "json")
	cmd.Flags().BoolVar(&all, "all", false, "events of every sandbox of the org")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep following new events")
	cmd.Flags().IntVar(&backlog, "backlog", 20, "start with this many recent events")
	cmd.Flags().StringVar(&since, "since", "", "start after this event id (what -o json prints as id)")
	return cmd
}

// eventLine is the one-line form for a terminal pane: time, type, subject, details.
func eventLine(e protocol.Event, withSandbox bool) string {
	var b strings.Builder
	b.WriteString(e.Time.Local().Format("15:04:05"))
	b.WriteString("\t")
	if withSandbox {
		b.WriteString(orDash(termSafe(e.Name)))
		b.WriteString("\t")
	}
	b.WriteString(termSafe(e.Type))
	b.WriteString("\t")
	switch e.Type {
	case protocol.EventExec:
		code := "?"
		if e.ExitCode != nil {
			code = fmt.Sprint(*e.ExitCode)
		}
		fmt.Fprintf(&b, "%s  -> exit %s", termSafe(e.Command), code)
		if e.DurationMS != nil {
			fmt.Fprintf(&b, " (%dms)", *e.DurationMS)
		}
		if e.Reason != "" {
			b.WriteString("  " + termSafe(e.Reason))
		}
	case protocol.EventShellStarted:
		b.WriteString(termSafe(e.Command))
	case protocol.EventShellEnded:
		code := "?"
		if e.ExitCode != nil {
			code = fmt.Sprint(*e.ExitCode)
		}
		fmt.Fprintf(&b, "%s  -> exit %s", termSafe(e.Command), code)
		if e.Reason != "" {
			b.WriteString("  " + termSafe(e.Reason))
		}
	case protocol.EventFileWritten, protocol.EventFileDeleted:
		b.WriteString(termSafe(e.Path))
	case protocol.EventSynced:
		if e.Files != nil && e.Bytes != nil {
			arrow := "<-"
			if e.Direction == "out" {
				arrow = "->"
			}
			fmt.Fprintf(&b, "%s %s %s, %s", termSafe(e.Path), arrow, count(*e.Files, "file", "files"), sizeIEC(*e.Bytes))
		}
	case protocol.EventExpiring:
		if e.SecondsLeft != nil {
			fmt.Fprintf(&b, "stops in %ds unless a heartbeat comes", *e.SecondsLeft)
		}
	case protocol.EventConnected, protocol.EventDisconnected, protocol.EventTokenMinted, protocol.EventTokenRevoked:
		if e.JTI != "" {
			b.WriteString("jti " + termSafe(e.JTI))
		} else {
			b.WriteString(termSafe(e.Actor))
		}
		if e.Reason != "" {
			b.WriteString(" " + termSafe(e.Reason))
		}
	default:
		b.WriteString(termSafe(e.Reason))
	}
	return strings.TrimRight(b.String(), "\t ")
}

func sweepCmd(g *globals) *cobra.Command {
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "sweep --dry-run",
		Short: "List sandboxes that look abandoned, with the reasons (clean up with sbctl delete)",
		Long: `List the org's orphan candidates with every reason: lease deadline passed, no heartbeat for a long
while, stopped by the sweeper (ttl_expired), stopped for a long time, failed, or created by an API
key that is now revoked. The broker itself only stops sandboxes whose lease expired (and deletes
long-stopped ones if it runs with --retention); deleting is yours: sbctl delete REF, or
sbctl delete --tag k=v for a batch.`,
		Example: "  sbctl sweep --dry-run\n  sbctl sweep --dry-run -o json",
		Args:    maxArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !dryRun {
				return usage.Errorf("sweep only reports (--dry-run); the broker stops expired sandboxes itself, and sbctl delete cleans up")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.Orphans(cmd.Context())
			if err != nil {
				return err
			}
			return g.print(res.Items, func(w io.Writer) {
				if len(res.Items) == 0 {
					fmt.Fprintln(w, "no orphan candidates")
					return
				}
				for _, o := range res.Items {
					fmt.Fprintf(w, "%s (%s) %s, tags %s\n", termSafe(o.Sandbox.Name), termSafe(o.Sandbox.ID), statusWord(o.Sandbox), tagString(o.Sandbox.Tags))
					for _, r := range o.Reasons {
						fmt.Fprintf(w, "  - %s\n", termSafe(r))
					}
				}
			})
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only list (the one mode: deleting is sbctl delete)")
	return cmd
}
