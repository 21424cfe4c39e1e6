package server

import (
	"context"
	"net/http"
	"time"
)

// AppendLease exposes appendLease to the package's external tests.
var AppendLease = appendLease

// DataplaneUsage is what the broker's dataplane holds for its clients right now, for tests that
// prove it is all given back.
type DataplaneUsage struct {
	// HeavySlots are broker-wide slots held by read, ls, glob and grep.
	HeavySlots int64
	// ExecOutputBytes is non-streamed exec output held against the broker-wide budget.
	ExecOutputBytes int64
	// QueuedBytes waits for clients in every connection's queue.
	QueuedBytes int64
	// ShellInputBytes are keystrokes waiting for shells' terminals.
	ShellInputBytes int64
	// OpMemoryBytes is what operations build in memory (names, answers) against the broker-wide
	// budget.
	OpMemoryBytes int64
}

// Usage reads s's dataplane accounting.
func Usage(s *Server) DataplaneUsage {
	heavy, _ := s.dpHeavy.inUse("")
	exec, _ := s.dpExecOutput.inUse("")
	queued, _ := s.dpQueued.inUse("")
	shellIn, _ := s.dpShellInput.inUse("")
	opMem, _ := s.dpOpMemory.inUse("")
	return DataplaneUsage{HeavySlots: heavy, ExecOutputBytes: exec, QueuedBytes: queued, ShellInputBytes: shellIn, OpMemoryBytes: opMem}
}

// OrgUsage is Usage for one org.
func OrgUsage(s *Server, org string) DataplaneUsage {
	_, heavy := s.dpHeavy.inUse(org)
	_, exec := s.dpExecOutput.inUse(org)
	_, queued := s.dpQueued.inUse(org)
	_, opMem := s.dpOpMemory.inUse(org)
	return DataplaneUsage{HeavySlots: heavy, ExecOutputBytes: exec, QueuedBytes: queued, OpMemoryBytes: opMem}
}

// SetOpMemoryBudget makes s's budget for what operations build in memory max bytes, at most share
// for one org; call it before any connection.
func SetOpMemoryBudget(s *Server, max, share int64) { s.dpOpMemory = newQuota(max, share) }

// OpenLocal exposes the MCP front end's in-process dataplane connection (openLocal).
var OpenLocal = (*Server).openLocal

// AuthorizeThenOpen opens an in-process dataplane connection to the sandbox ref with cred as the
// MCP front end does (openLocal), calling between after the credential's checks and before the
// connection takes its place in the hub: the window a revocation can land in. It answers a channel
// closed when the connection ends.
func AuthorizeThenOpen(s *Server, cred, ref string, between func()) (<-chan struct{}, error) {
	c, releaseShare, err := s.authorizeConn(context.Background(), cred, ref, http.Header{})
	if err != nil {
		return nil, err
	}
	between()
	log, unregister := c.open("test")
	go func() {
		<-c.ctx.Done()
		c.closed(log, unregister)
		releaseShare()
	}()
	return c.ctx.Done(), nil
}

// RevocationsMissed runs what a revocation resubscription runs (Server.revocationsMissed).
func RevocationsMissed(s *Server) { s.revocationsMissed() }

// SetUploadIdle sets how long an upload's body may send nothing (default 75 s); call it before
// the broker serves uploads.
func SetUploadIdle(s *Server, d time.Duration) { s.uploadIdle = d }

// SetBodyWait sets how long a REST request's body may take to arrive (default bodyWait); call it
// before any request.
func SetBodyWait(s *Server, d time.Duration) { s.bodyWait = d }

// SetReaderHook makes s run hook on a dataplane connection's reader before each request is
// dispatched. Set it before any connection.
func SetReaderHook(s *Server, hook func(op string)) { s.readerHook = hook }
