// Package store is the broker's Redis state: sandbox records with their name, tag and deadline
// indexes, API keys and orgs, and the Lua scripts that keep multi-key updates atomic. It also runs
// the embedded Redis the broker uses when no --redis-url is given.
//
// It knows nothing of HTTP, processes or tokens: callers get records and sentinel errors back.
// Lease times come from Redis' own clock (TIME inside the scripts; a test clock through Options),
// so every broker agrees on them. Every call is bounded (Options.Timeout), and an outage the store
// saw gives leases their grace when Redis returns (GrantGrace). Keys come only from keys.go.
package store
