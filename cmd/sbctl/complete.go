package main

import (
	"context"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
)

// Shell completion (sbctl completion bash|zsh|fish|powershell) completes REF arguments with the
// org's sandbox names and --tag flags with the tags its sandboxes carry, asking the broker. A broker
// that does not answer quickly gives no suggestions rather than a hanging prompt.

// completionTimeout bounds the one list request a completion makes.
const completionTimeout = 2 * time.Second

// addCompletions wires REF and --tag completion into every command of root whose usage takes them.
func addCompletions(g *globals, root *cobra.Command) {
	for _, cmd := range root.Commands() {
		use := cmd.Use
		manyRefs := strings.Contains(use, "REF...")
		switch {
		case cmd.ValidArgsFunction != nil:
		case strings.Contains(use, " REF") || strings.Contains(use, "(REF") || strings.HasPrefix(use, "create [NAME]") || strings.HasPrefix(use, "watch [REF]"):
			cmd.ValidArgsFunction = func(cmd *cobra.Command, args []string, prefix string) ([]string, cobra.ShellCompDirective) {
				if len(args) > 0 && !manyRefs {
					return nil, cobra.ShellCompDirectiveNoFileComp
				}
				return g.completeNames(cmd.Context(), prefix, args), cobra.ShellCompDirectiveNoFileComp
			}
		}
		if cmd.Flags().Lookup("tag") != nil {
			cmd.RegisterFlagCompletionFunc("tag", func(cmd *cobra.Command, _ []string, prefix string) ([]string, cobra.ShellCompDirective) {
				return g.completeTags(cmd.Context(), prefix), cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
			})
		}
		if cmd.Flags().Lookup("status") != nil {
			cmd.RegisterFlagCompletionFunc("status", func(_ *cobra.Command, _ []string, prefix string) ([]string, cobra.ShellCompDirective) {
				var out []string
				for _, s := range []string{protocol.StatusProvisioning, protocol.StatusRunning, protocol.StatusStopped, protocol.StatusFailed, protocol.StatusDeleting} {
					if strings.HasPrefix(s, prefix) {
						out = append(out, s)
					}
				}
				return out, cobra.ShellCompDirectiveNoFileComp
			})
		}
	}
}

// sandboxesForCompletion lists the org's sandboxes, or nothing on any error: a completion has no
// place to show one.
func (g *globals) sandboxesForCompletion(ctx context.Context) []protocol.Sandbox {
	if ctx == nil {
		ctx = context.Background()
	}
	c, err := g.client()
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, completionTimeout)
	defer cancel()
	all, err := c.ListAllSandboxes(ctx, client.ListOptions{})
	if err != nil {
		return nil
	}
	return all
}

// completeNames is the names starting with prefix, minus those already given.
func (g *globals) completeNames(ctx context.Context, prefix string, given []string) []string {
	var out []string
	for _, s := range g.sandboxesForCompletion(ctx) {
		if strings.HasPrefix(s.Name, prefix) && completable(s.Name) && !slices.Contains(given, s.Name) {
			out = append(out, s.Name)
		}
	}
	sort.Strings(out)
	return out
}

// completeTags is every key=value the org's sandboxes carry that starts with prefix.
func (g *globals) completeTags(ctx context.Context, prefix string) []string {
	seen := map[string]bool{}
	for _, s := range g.sandboxesForCompletion(ctx) {
		for k, v := range s.Tags {
			if kv := k + "=" + v; strings.HasPrefix(kv, prefix) && completable(kv) {
				seen[kv] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for kv := range seen {
		out = append(out, kv)
	}
	sort.Strings(out)
	return out
}

// completable keeps out what a shell would split or a terminal would act on: a suggestion is
// typed into the command line as is.
func completable(s string) bool {
	return s != "" && termSafe(s) == s && !strings.ContainsAny(s, " '\"\\$`;&|<>()*?[]{}!#~")
}
