package main

import (
	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/store"
)

// limitFlags are the default org limits: serve enforces them on orgs without limits of their own,
// and `broker orgs get-limits` shows them beside an org's own.
func limitFlags(fs *pflag.FlagSet, c *config) {
	fs.IntVar(&c.Limits.MaxRunning, "org-max-running", 100, "default limit on each org's sandboxes provisioning or running at once, on every broker sharing the Redis (0: no limit; `broker orgs set-limits` sets an org's own)")
}

// validateLimits checks the default org limits.
func (c *config) validateLimits(bad func(flag, format string, args ...any)) {
	for flag, v := range map[string]int{"org-max-running": c.Limits.MaxRunning} {
		if v < 0 || v > store.MaxLimit {
			bad(flag, "%d must be between 0 (no limit) and %d", v, store.MaxLimit)
		}
	}
}
