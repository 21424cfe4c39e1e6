package main

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/protocol"
)

func limitsCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "limits",
		Short: "Show your org's limits and what it uses of them",
		Long: `Show the org's limits: max_running (sandboxes provisioning or running at once, on every broker),
max_sandboxes (sandboxes in any state, stopped ones included), rps and burst (requests per second
of each API key, per broker) and connections (open dataplane connections, per broker). IN USE is
what the org holds now of max_running and max_sandboxes. FROM says whether the org has a limit of
its own or the broker's default; none means no limit. A request past a limit is refused
with quota_exceeded or rate_limited (exit 7); the broker's operator raises limits with
broker orgs set-limits.`,
		Example: "  sbctl limits\n  sbctl limits -o json",
		Args:    maxArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.Limits(cmd.Context())
			if err != nil {
				return err
			}
			return g.print(res, func(w io.Writer) {
				own := map[string]bool{}
				for _, n := range res.Own {
					own[n] = true
				}
				tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
				fmt.Fprintf(tw, "org %s\n\nLIMIT\tVALUE\tIN USE\tFROM\n", res.Org)
				for _, r := range []struct {
					name  string
					value int
					used  string
				}{
					{"max_running", res.Limits.MaxRunning, strconv.Itoa(res.Usage.Running)},
					{"max_sandboxes", res.Limits.MaxSandboxes, strconv.Itoa(res.Usage.Sandboxes)},
					{"rps", res.Limits.RPS, ""},
					{"burst", res.Limits.Burst, ""},
					{"connections", res.Limits.Connections, ""},
				} {
					v, from := "none", "default"
					if r.value > 0 {
						v = strconv.Itoa(r.value)
					}
					if own[r.name] {
						from = "org"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.name, v, r.used, from)
				}
				tw.Flush()
			})
		},
	}
}

// limitedCodes are the codes of answers refused by a limit (exit 7).
var limitedCodes = map[string]bool{protocol.CodeQuotaExceeded: true, protocol.CodeRateLimited: true,
	protocol.CodeTooManyConnections: true}
