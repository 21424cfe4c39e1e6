package protocol

// Codes of answers refused by a limit (HTTP 429, with a Retry-After header).
const (
	// CodeQuotaExceeded: the org is at one of its limits (max_running, max_sandboxes); the message says which and
	// how to raise it. Retrying helps only once the org uses less.
	CodeQuotaExceeded = "quota_exceeded"
	// CodeRateLimited: too many requests from this credential, or too many failed authentications
	// from this address; retry after the Retry-After header's seconds.
	CodeRateLimited = "rate_limited"
)

// OrgLimits are an org's limits (GET /v1/limits). Zero means no limit.
type OrgLimits struct {
	// MaxRunning bounds the org's sandboxes provisioning or running at once, on every broker.
	MaxRunning int `json:"max_running"`
	// MaxSandboxes bounds the org's sandboxes in any state (stopped ones too), on every broker.
	MaxSandboxes int `json:"max_sandboxes"`
	// RPS is the requests per second each credential may make, per broker; Burst how many at once.
	RPS   int `json:"rps"`
	Burst int `json:"burst"`
	// Connections bounds the org's open dataplane connections, per broker.
	Connections int `json:"connections"`
}

// LimitsUsage is what the org uses of its limits now.
type LimitsUsage struct {
	Running int `json:"running"`
	// Sandboxes counts the org's sandboxes in any state, stopped ones included: what max_sandboxes
	// bounds.
	Sandboxes int `json:"sandboxes"`
}

// LimitsResponse is the answer of GET /v1/limits.
type LimitsResponse struct {
	Org    string      `json:"org"`
	Limits OrgLimits   `json:"limits"`
	Usage  LimitsUsage `json:"usage"`
	// Own names the limits the org has of its own; the others are the broker's defaults.
	Own []string `json:"own"`
}
