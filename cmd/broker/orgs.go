package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/store"
)

// limitFlags are the default org limits: serve enforces them on orgs without limits of their own,
// and `broker orgs get-limits` shows them beside an org's own.
func limitFlags(fs *pflag.FlagSet, c *config) {
	fs.IntVar(&c.Limits.MaxRunning, "org-max-running", 100, "default limit on each org's sandboxes provisioning or running at once, on every broker sharing the Redis (0: no limit; broker orgs set-limits sets an org's own)")
	fs.IntVar(&c.Limits.MaxSandboxes, "org-max-sandboxes", 1000, "default limit on each org's sandboxes in any state, stopped ones included (each holds files and a host uid), on every broker sharing the Redis (0: no limit)")
	fs.IntVar(&c.Limits.RPS, "org-rps", 100, "default requests per second each credential (API key) of an org may make, per broker (0: no limit)")
	fs.IntVar(&c.Limits.Burst, "org-burst", 200, "default requests a credential may make at once before --org-rps paces it (0: as many as --org-rps)")
	fs.IntVar(&c.MaxDPConnsPerOrg, "max-dataplane-connections-per-org", server.DefaultDataplaneConnsPerOrg, "default dataplane connections one org may have open on this broker; past it an upgrade is 429 too_many_connections (broker orgs set-limits ORG --connections N sets an org's own)")
}

// authFlags bound failed authentications per source address.
func authFlags(fs *pflag.FlagSet, c *config) {
	fs.IntVar(&c.AuthFailures, "auth-failures", 20, "failed authentications one source address may make per --auth-failure-window before it must wait the window out (0: no limit)")
	fs.DurationVar(&c.AuthFailureWindow, "auth-failure-window", time.Minute, "the window --auth-failures counts in")
}

// validateLimits checks the default org limits.
func (c *config) validateLimits(bad func(flag, format string, args ...any)) {
	for _, f := range []struct {
		flag string
		v    int
	}{{"org-max-running", c.Limits.MaxRunning}, {"org-max-sandboxes", c.Limits.MaxSandboxes}, {"org-rps", c.Limits.RPS}, {"org-burst", c.Limits.Burst}} {
		if f.v < 0 || f.v > store.MaxLimit {
			bad(f.flag, "%d must be between 0 (no limit) and %d", f.v, store.MaxLimit)
		}
	}
}

// validateAuth checks the bound on failed authentications.
func (c *config) validateAuth(bad func(flag, format string, args ...any)) {
	if c.AuthFailures < 0 || c.AuthFailures > store.MaxLimit {
		bad("auth-failures", "%d must be between 0 (no limit) and %d", c.AuthFailures, store.MaxLimit)
	}
	if c.AuthFailureWindow < time.Second {
		bad("auth-failure-window", "must be at least 1s")
	}
}

// orgsCmd administers orgs' limits directly in Redis, like keysCmd.
func orgsCmd(c *config) *cobra.Command {
	orgs := &cobra.Command{
		Use:   "orgs",
		Short: "Show and set orgs' limits",
		Long: `Each org has limits: max_running (sandboxes provisioning or running at once, on every broker),
max_sandboxes (sandboxes in any state, stopped ones included, on every broker),
rps and burst (requests per second of each of its credentials, per broker), connections (its open
dataplane connections, per broker). An org without limits of its own gets the serving brokers'
defaults (--org-max-running, --org-max-sandboxes, --org-rps, --org-burst, --max-dataplane-connections-per-org). 0 means
no limit. Changes reach max_running at once and the rate limits of every broker within 5 seconds.`,
		Example: `  broker orgs get-limits acme
  broker orgs set-limits acme --max-running 20 --rps 50`,
	}
	orgs.AddCommand(orgsSetLimitsCmd(c), orgsGetLimitsCmd(c))
	// The defaults, to show beside an org's own: give the same flags or SBX_* variables as serve.
	limitFlags(orgs.PersistentFlags(), c)
	return orgs
}

// limitValue is a flag value of set-limits: a number, or "default" to drop the org's own.
type limitValue struct {
	v     int
	clear bool
	set   bool
}

func (l *limitValue) String() string {
	if l.clear {
		return "default"
	}
	return strconv.Itoa(l.v)
}

func (l *limitValue) Set(s string) error {
	if s == "default" {
		l.clear, l.set = true, true
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n > store.MaxLimit {
		return fmt.Errorf("%q is not a number from 0 (no limit) to %d, or default", s, store.MaxLimit)
	}
	l.v, l.clear, l.set = n, false, true
	return nil
}

func (l *limitValue) Type() string { return "N|default" }

func orgsSetLimitsCmd(c *config) *cobra.Command {
	vals := map[string]*limitValue{}
	cmd := &cobra.Command{
		Use:   "set-limits ORG [--max-running N] [--max-sandboxes N] [--rps N] [--burst N] [--connections N]",
		Short: "Give an org limits of its own (N, 0 for no limit, or default for the brokers' default)",
		Example: `  broker orgs set-limits acme --max-running 20 --rps 50
  broker orgs set-limits acme --rps default     # back to --org-rps`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			set, clear := map[string]int{}, []string{}
			for _, name := range store.LimitNames {
				switch v := vals[name]; {
				case !v.set:
				case v.clear:
					clear = append(clear, name)
				default:
					set[name] = v.v
				}
			}
			if len(set)+len(clear) == 0 {
				return usage.Errorf("nothing to set: give --max-running, --max-sandboxes, --rps, --burst or --connections; see %s --help", cmd.CommandPath())
			}
			org := args[0]
			return withStore(cmd, c, func(s *store.Store) error {
				err := s.SetOrgLimits(cmd.Context(), org, set, clear)
				if errors.Is(err, store.ErrNotFound) {
					return fmt.Errorf("no org %q: orgs come with their first API key (broker keys create --org %s --name NAME); see broker keys list", org, org)
				}
				if err != nil {
					return err
				}
				return printLimits(cmd, c, s, org, "table")
			})
		},
	}
	for _, name := range store.LimitNames {
		vals[name] = &limitValue{}
		flag := strings.ReplaceAll(name, "_", "-")
		cmd.Flags().Var(vals[name], flag, limitHelp[name])
	}
	return cmd
}

var limitHelp = map[string]string{
	store.LimitMaxSandboxes: "sandboxes in any state, stopped ones included, on every broker",
	store.LimitMaxRunning:   "sandboxes provisioning or running at once, on every broker",
	store.LimitRPS:          "requests per second of each API key of the org, per broker",
	store.LimitBurst:        "requests an API key may make at once before --rps paces it",
	store.LimitConnections:  "dataplane connections the org may have open, per broker",
}

// orgDefaults are the limits of orgs without their own: the --org-* flags, and the dataplane's
// per-org connection cap, whose one default is --max-dataplane-connections-per-org.
func (c *config) orgDefaults() store.Limits {
	l := c.Limits
	l.Connections = c.MaxDPConnsPerOrg
	return l
}

func orgsGetLimitsCmd(c *config) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "get-limits ORG",
		Short: "Show an org's limits (its own, else the defaults) and its sandboxes, running and all",
		Example: `  broker orgs get-limits acme
  broker orgs get-limits default -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "table" && output != "json" {
				return usage.Errorf("-o must be table or json, not %q", output)
			}
			return withStore(cmd, c, func(s *store.Store) error {
				return printLimits(cmd, c, s, args[0], output)
			})
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output: table or json")
	return cmd
}

// printLimits shows org's limits as sbctl limits does: each limit's value and where it comes from.
func printLimits(cmd *cobra.Command, c *config, s *store.Store, org, output string) error {
	ctx := cmd.Context()
	if c.validateLimitsErr() != nil {
		return c.validateLimitsErr()
	}
	known, err := s.OrgExists(ctx, org)
	if err != nil {
		return err
	}
	if !known {
		return fmt.Errorf("no org %q (see broker keys list)", org)
	}
	own, err := s.OrgLimits(ctx, org)
	if err != nil {
		return err
	}
	running, err := s.Running(ctx, org)
	if err != nil {
		return err
	}
	sandboxes, err := s.Sandboxes(ctx, org)
	if err != nil {
		return err
	}
	l := c.orgDefaults().With(own)
	res := protocol.LimitsResponse{Org: org, Limits: protocol.OrgLimits{MaxRunning: l.MaxRunning, MaxSandboxes: l.MaxSandboxes, RPS: l.RPS, Burst: l.Burst, Connections: l.Connections},
		Usage: protocol.LimitsUsage{Running: running, Sandboxes: sandboxes}, Own: []string{}}
	for _, name := range store.LimitNames {
		if _, ok := own[name]; ok {
			res.Own = append(res.Own, name)
		}
	}
	if output == "json" {
		return json.NewEncoder(os.Stdout).Encode(res)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "org %s\n\nLIMIT\tVALUE\tIN USE\tFROM\n", org)
	for _, name := range store.LimitNames {
		v, from, used := "none", "default", ""
		if n := l.Get(name); n > 0 {
			v = strconv.Itoa(n)
		}
		if _, ok := own[name]; ok {
			from = "org"
		}
		switch name {
		case store.LimitMaxRunning:
			used = strconv.Itoa(running)
		case store.LimitMaxSandboxes:
			used = strconv.Itoa(sandboxes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", name, v, used, from)
	}
	return tw.Flush()
}

// validateLimitsErr checks the default limits given to an admin command.
func (c *config) validateLimitsErr() error {
	var errs []error
	c.validateLimits(func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--%s (%s): %s", flag, envOf[flag], fmt.Sprintf(format, args...)))
	})
	return errors.Join(errs...)
}
