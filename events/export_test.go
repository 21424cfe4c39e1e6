package events

// Live reports whether a subscription takes live events from its org's reader (its catch-up is
// over), for tests that must start from that state.
func Live(s *Subscription) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.live
}
