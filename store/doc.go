// Package store is the broker's Redis state: sandbox records with their name, tag and deadline
// indexes, API keys and orgs, and the Lua scripts that keep multi-key updates atomic. It also runs
// the embedded Redis the broker uses when no --redis-url is given.
//
// It knows nothing of HTTP, processes or tokens: callers pass in the time (so tests control the
// clock) and get records and sentinel errors back. Keys come only from keys.go.
package store
