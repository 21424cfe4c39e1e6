package main

import (
	"time"

	"github.com/spf13/pflag"

	"github.com/sbxbroker/broker/store"
)

// limitFlags are the default org limits: serve enforces them on orgs without limits of their own,
// and `broker orgs get-limits` shows them beside an org's own.
func limitFlags(fs *pflag.FlagSet, c *config) {
	fs.IntVar(&c.Limits.MaxRunning, "org-max-running", 100, "default limit on each org's sandboxes provisioning or running at once, on every broker sharing the Redis (0: no limit; `broker orgs set-limits` sets an org's own)")
	fs.IntVar(&c.Limits.RPS, "org-rps", 100, "default requests per second each credential (API key) of an org may make, per broker (0: no limit)")
	fs.IntVar(&c.Limits.Burst, "org-burst", 200, "default requests a credential may make at once before --org-rps paces it (0: as many as --org-rps)")
}

// authFlags bound failed authentications per source address.
func authFlags(fs *pflag.FlagSet, c *config) {
	fs.IntVar(&c.AuthFailures, "auth-failures", 20, "failed authentications one source address may make per --auth-failure-window before it must wait the window out (0: no limit)")
	fs.DurationVar(&c.AuthFailureWindow, "auth-failure-window", time.Minute, "the window --auth-failures counts in")
}

// validateLimits checks the default org limits.
func (c *config) validateLimits(bad func(flag, format string, args ...any)) {
	for flag, v := range map[string]int{"org-max-running": c.Limits.MaxRunning, "org-rps": c.Limits.RPS, "org-burst": c.Limits.Burst,
		"auth-failures": c.AuthFailures} {
		if v < 0 || v > store.MaxLimit {
			bad(flag, "%d must be between 0 (no limit) and %d", v, store.MaxLimit)
		}
	}
	if c.AuthFailureWindow < time.Second {
		bad("auth-failure-window", "must be at least 1s")
	}
}
