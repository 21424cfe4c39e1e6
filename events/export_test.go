package events

// Live reports whether a subscription takes live events from its org's reader (its catch-up is
// over), for tests that must start from that state.
func Live(s *Subscription) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.live
}

// OnWrite has w call f as each write to Redis starts (set before the first Emit).
func OnWrite(w *Writer, f func()) { w.onWrite = f }
