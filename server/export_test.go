package server

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
}

// Usage reads s's dataplane accounting.
func Usage(s *Server) DataplaneUsage {
	heavy, _ := s.dpHeavy.inUse("")
	exec, _ := s.dpExecOutput.inUse("")
	queued, _ := s.dpQueued.inUse("")
	shellIn, _ := s.dpShellInput.inUse("")
	return DataplaneUsage{HeavySlots: heavy, ExecOutputBytes: exec, QueuedBytes: queued, ShellInputBytes: shellIn}
}

// OrgUsage is Usage for one org.
func OrgUsage(s *Server, org string) DataplaneUsage {
	_, heavy := s.dpHeavy.inUse(org)
	_, exec := s.dpExecOutput.inUse(org)
	_, queued := s.dpQueued.inUse(org)
	return DataplaneUsage{HeavySlots: heavy, ExecOutputBytes: exec, QueuedBytes: queued}
}

// OpenLocal exposes the MCP front end's in-process dataplane connection (openLocal).
var OpenLocal = (*Server).openLocal
