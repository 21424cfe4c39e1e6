// Package membudget lets the caller of an operation bound the memory the operation builds (the
// names a tree walk holds, the answer a listing assembles) by a budget it shares with other
// operations, without the operation knowing whose budget it is: the caller puts a Meter in the
// operation's context, and the operation draws on it as what it holds grows and gives back what it
// drops. An operation given no Meter draws on nothing. It imports nothing of ours, so that the
// packages doing the work (tartree, baseline, sandbox/workspace) need not know the broker.
package membudget

import "context"

// Meter is one operation's account with a shared budget.
type Meter interface {
	// Grow takes n more bytes, or refuses with the error the operation must stop with and return
	// as it is (it says why, and what to do): a *protocol.Error, which the operations pass on
	// untranslated.
	Grow(n int64) error
	// Shrink gives back n bytes taken by Grow and no longer held.
	Shrink(n int64)
}

type meterKey struct{}

// With returns ctx carrying m for the operations run with it.
func With(ctx context.Context, m Meter) context.Context {
	return context.WithValue(ctx, meterKey{}, m)
}

// From returns the Meter ctx carries, or one that takes everything and holds nothing.
func From(ctx context.Context) Meter {
	if m, ok := ctx.Value(meterKey{}).(Meter); ok {
		return m
	}
	return unmetered{}
}

type unmetered struct{}

func (unmetered) Grow(int64) error { return nil }
func (unmetered) Shrink(int64)     {}

// StringCost is what holding the string s costs: its bytes and its header.
func StringCost(s string) int64 { return int64(len(s)) + 16 }
