package protocol

import "time"

// Event types on the SSE streams (GET /v1/sandboxes/{ref}/events, GET /v1/events).
const (
	EventCreated      = "created"
	EventReused       = "reused"
	EventResumed      = "resumed"
	EventStopped      = "stopped" // reason: requested | ttl_expired | runtime_lost | memory_limit
	EventFailed       = "failed"  // reason: create_failed | start_failed | setup_failed | broker_restart
	EventDeleted      = "deleted"
	EventExpiring     = "expiring" // seconds_left before the sweeper stops it
	EventConnected    = "connected"
	EventDisconnected = "disconnected"
	EventFileWritten  = "file_written"
	EventFileDeleted  = "file_deleted"
	// EventSynced reports a tree copied in (untar) or out (tar): path, files, bytes, direction.
	EventSynced       = "synced"
	EventExec         = "exec"
	EventTokenMinted  = "token_minted"
	EventTokenRevoked = "token_revoked"
	// EventReset is sent to a resuming subscriber whose Last-Event-ID fell out of the stream: events
	// between it and the first event that follows were lost.
	EventReset = "reset"
	// EventNodeLost: the broker hosting the sandbox stopped renewing its liveness record and
	// another broker declared it lost; EventNodeReturned: it is back and serves the sandbox again.
	EventNodeLost     = "node_lost"
	EventNodeReturned = "node_returned"
	// EventGap: a broker could not keep every event of the sandbox while Redis was away (its
	// buffer was full); Missed says how many were lost at this point of the stream.
	EventGap = "gap"
)

// Reasons of failed (and, for broker_restart, resumed) events. They are codes, never the failure's
// text: that can carry a setup command's output, so it stays on the record (Sandbox.Failure), which
// only the owner reads.
const (
	ReasonCreateFailed  = "create_failed"  // the provider could not create the sandbox
	ReasonStartFailed   = "start_failed"   // the provider could not start it
	ReasonSetupFailed   = "setup_failed"   // the template's setup command failed
	ReasonBrokerRestart = "broker_restart" // the broker restarted while it was created, or while it ran
)

// SSEEventName is the SSE "event:" field of every sandbox event.
const SSEEventName = "sandbox"

// Event is one sandbox event: the SSE data field. Events name a token by its jti, never carry it.
type Event struct {
	// ID is the event's position in the org's stream (the SSE id, for Last-Event-ID).
	ID        string    `json:"id,omitempty"`
	Type      string    `json:"type"`
	SandboxID string    `json:"sandbox_id"`
	Name      string    `json:"name,omitempty"`
	Time      time.Time `json:"time"`
	// Actor is who caused it: "key:<api key id>", "token:<jti>", "sweeper", "broker".
	Actor string `json:"actor,omitempty"`
	// Reason qualifies stopped, failed, resumed and reset events, with a code (Stop*, Reason*).
	Reason string `json:"reason,omitempty"`
	// Path for file events; Command, ExitCode and DurationMS for exec.
	Path       string `json:"path,omitempty"`
	Command    string `json:"command,omitempty"`
	ExitCode   *int   `json:"exit_code,omitempty"`
	DurationMS *int64 `json:"duration_ms,omitempty"`
	// JTI names the token for connected, disconnected, token_minted and token_revoked.
	JTI string `json:"jti,omitempty"`
	// SecondsLeft before the sweeper may stop it, for expiring: the deadline, or the warning window
	// from the warning when that is later (never less than the window; 0 when a restarted broker
	// found the lease run out).
	SecondsLeft *int64 `json:"seconds_left,omitempty"`
	// Missed counts the events a gap stands for.
	Missed *int64 `json:"missed,omitempty"`
	// Files, Bytes and Direction ("in" or "out") for synced: what a tree copy moved.
	Files     *int   `json:"files,omitempty"`
	Bytes     *int64 `json:"bytes,omitempty"`
	Direction string `json:"direction,omitempty"`
	// Status is the sandbox's status after the event, where it changed.
	Status string `json:"status,omitempty"`
}
