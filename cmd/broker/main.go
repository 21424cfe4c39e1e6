// Command broker is the sandbox broker daemon: it runs sandboxes on this host, keeps their records in
// Redis, mints delegation tokens and serves the REST API, the dataplane and the event streams.
//
//	broker                       serve, on the embedded defaults (see --help)
//	broker keys create|list|revoke|rotate-signing
//	broker orgs set-limits|get-limits
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/sandbox/provider"
)

func main() {
	// The broker binary is also every sandbox's resident init (see sandbox/provider).
	if len(os.Args) > 1 && os.Args[1] == provider.InitArg {
		provider.RunInit()
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the broker's command line and returns its exit code: 2 for a wrong command line
// (usage.Error), 1 for any other error.
func run(args []string, stdout, stderr io.Writer) int {
	root := rootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.Execute()
	if err == nil {
		return 0
	}
	fmt.Fprintln(stderr, "broker:", err)
	if usage.Is(err) {
		return 2
	}
	return 1
}

func rootCmd() *cobra.Command {
	c := &config{}
	root := &cobra.Command{
		Use:   "broker",
		Short: "Run the sandbox broker",
		Long: `The sandbox broker runs sandboxes on this host for AI coding clients, and lends them to agent
servers through narrow, short-lived delegation tokens.

With no flags it starts on its embedded defaults: an embedded redis-server keeping its data in
--data-dir, the strongest sandbox provider this machine supports, and the API on 127.0.0.1:7070.
On the first start it creates the org "default" with an API key and writes sbctl's config file, so
sbctl works at once.

Every flag has an environment fallback, named in its help (SBX_LISTEN, SBX_REDIS_URL, ...).

Listening on every interface (--listen 0.0.0.0:7070) for agent servers on other hosts? Set
--advertise-url to the URL they reach this broker at: dataplane_url in run-config blocks is built
from it, and without it points at 127.0.0.1.

Exit codes: 0 ok, 2 a wrong command line or setting (the message says which and what to do),
1 anything else.`,
		Example: `  broker                                   # embedded defaults
  broker --provider namespace --log-format json
  broker --redis-url redis://10.0.0.5:6379 --advertise-url http://broker.internal:7070
  SBX_REDIS_URL=redis-sentinel://s1:26379,s2:26379/main broker`,
		// The root serves and takes no arguments: one is a mistyped command (broker kyes: did you
		// mean keys?).
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usage.Errorf("unknown command %q%s; see broker --help", args[0], usage.DidYouMean(cmd, args[0]))
			}
			return nil
		},
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd); err != nil {
				return err
			}
			if err := c.validate(); err != nil {
				return usage.Errorf("invalid configuration:\n%v", err)
			}
			return serve(cmd.Context(), c)
		},
	}
	root.Version = client.Version()
	root.SetVersionTemplate("{{.Name}} {{.Version}}\n")
	storageFlags(root.PersistentFlags(), c)
	serveFlags(root.Flags(), c)
	limitFlags(root.Flags(), c)
	authFlags(root.Flags(), c)
	root.AddCommand(keysCmd(c), orgsCmd(c))
	annotateEnv(root)
	usage.Guard(root)
	return root
}
