// Package membudgettest is a membudget.Meter for the tests of the packages that draw on one: a
// budget of Limit bytes that counts what is held and its peak, and refuses with ErrSpent.
package membudgettest

import "github.com/sbxbroker/broker/protocol"

// ErrSpent is a Meter's refusal: a protocol error, as the broker's is (operations pass it on as it is).
var ErrSpent = protocol.Errorf(protocol.CodeTooManyRequests, "the budget is spent")

// Meter is a budget of Limit bytes. It is not safe for concurrent use.
type Meter struct{ Limit, Held, Peak int64 }

// Grow takes n bytes, or refuses with ErrSpent past Limit.
func (m *Meter) Grow(n int64) error {
	if m.Held+n > m.Limit {
		return ErrSpent
	}
	m.Held += n
	m.Peak = max(m.Peak, m.Held)
	return nil
}

// Shrink gives back n bytes.
func (m *Meter) Shrink(n int64) { m.Held -= n }
