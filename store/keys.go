package store

import "strings"

// Every key of one org carries the hash tag {org}, so multi-key Lua scripts (a create touches the
// sandbox hash, the name index, tag indexes and the deadline set) run unchanged on Redis Cluster.
// Keys come only from these helpers; nothing else spells a key.

func orgKey(org string, parts ...string) string {
	return "sbx:{" + org + "}:" + strings.Join(parts, ":")
}

// SandboxKey is the hash holding one sandbox record.
func SandboxKey(org, id string) string { return orgKey(org, "sb", id) }

// CreatedKey marks, for a minute, that the create of sandbox id ran (createScript): a resend of
// that create whose record is gone since (deleted in between) is then told so, not made again.
func CreatedKey(org, id string) string { return orgKey(org, "created", id) }

// NamesKey is the org's name index: a hash of name -> sandbox id.
func NamesKey(org string) string { return orgKey(org, "names") }

// AllKey is the org's sandboxes in creation order: a sorted set of id scored by created_at (ms).
func AllKey(org string) string { return orgKey(org, "all") }

// TagKey indexes the org's sandboxes carrying tag k=v: a sorted set scored like AllKey.
func TagKey(org, k, v string) string { return orgKey(org, "tag", k+"="+v) }

// DeadlinesKey holds the org's running sandboxes with a lease: a sorted set of id scored by
// expires_at (ms). The sweeper reads only what expired.
func DeadlinesKey(org string) string { return orgKey(org, "deadlines") }

// StoppedKey holds the org's stopped sandboxes scored by stopped_at (ms), for retention.
func StoppedKey(org string) string { return orgKey(org, "stopped") }

// WarnedKey holds the org's sandboxes that were sent an expiring warning for their current deadline:
// a sorted set of id scored by the deadline warned about.
func WarnedKey(org string) string { return orgKey(org, "warned") }

// RevokedKey is a revoked delegation token's deny-list entry; it expires with the token.
func RevokedKey(org, jti string) string { return orgKey(org, "revoked", jti) }

// DelegationsKey holds metadata of the tokens minted for one sandbox: a hash of jti -> JSON.
func DelegationsKey(org, sandboxID string) string { return orgKey(org, "dlg", sandboxID) }

// ActiveKey holds the org's sandboxes that are provisioning or running: a set of ids, what the org's
// max_running limit counts.
func ActiveKey(org string) string { return orgKey(org, "active") }

// LimitsKey is the org's own limits: a hash of limit name (max_running, rps, burst) -> value.
// A limit not in it is the broker's default.
func LimitsKey(org string) string { return orgKey(org, "limits") }

// EventsKey is the org's event stream.
func EventsKey(org string) string { return orgKey(org, "events") }

// Keys outside any org.
const (
	// OrgsKey is the set of org names.
	OrgsKey = "sbx:orgs"
	// SweepLockKey is held by the broker that sweeps.
	SweepLockKey = "sbx:sweep-lock"
	// RevocationsChannel carries revocations to every broker, so open dataplane connections close.
	RevocationsChannel = "sbx:revocations"
	// EventsChannel carries wake-ups, an org name each, when events were appended to that org's
	// stream, so brokers' event readers need not block on every stream.
	EventsChannel = "sbx:events"
)

// APIKeyKey is the hash of one API key (its hash, org, name, created_at, revoked_at).
func APIKeyKey(keyID string) string { return "sbx:apikey:" + keyID }

// OrgAPIKeysKey is the set of an org's API key ids.
func OrgAPIKeysKey(org string) string { return orgKey(org, "apikeys") }

// NodeChannel carries lifecycle commands to the broker that hosts a sandbox.
func NodeChannel(node string) string { return "sbx:node:" + node }

// Node keys share one hash tag, so the node scripts run on Redis Cluster:
// NodesKey is a hash of node name -> the base URL clients reach that broker at; NodesSeenKey a
// sorted set of node name by its last liveness beat (ms on the lease clock); NodesLostKey the set
// of nodes declared lost and not back since.
const (
	NodesKey     = "sbx:{nodes}:urls"
	NodesSeenKey = "sbx:{nodes}:seen"
	NodesLostKey = "sbx:{nodes}:lost"
)

// APIKeyRevokedChannel announces revoked API key ids, so brokers drop them from their caches at once
// and close the dataplane connections and event streams of the key and of the tokens it minted.
const APIKeyRevokedChannel = "sbx:apikey-revoked"
