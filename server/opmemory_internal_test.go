package server

import (
	"errors"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// TestOpMemoryAccounting: an operation's account takes the budget a grain at a time, within its
// org's share, gives back what it no longer needs past one spare grain, and everything at free;
// after free it is refused, so an operation that outlives its request holds nothing.
func TestOpMemoryAccounting(t *testing.T) {
	budget := newQuota(16*dpOpMemoryGrain, 8*dpOpMemoryGrain)
	a := &opMemory{budget: budget, org: "a"}
	if err := a.Grow(10); err != nil {
		t.Fatal(err)
	}
	if all, _ := budget.inUse(""); all != dpOpMemoryGrain {
		t.Fatalf("10 bytes took %d of the budget, want one grain", all)
	}
	if err := a.Grow(7 * dpOpMemoryGrain); err != nil {
		t.Fatal(err)
	}
	// The org's share is 8 grains: a second account of the same org cannot take a ninth.
	b := &opMemory{budget: budget, org: "a", op: protocol.OpUntar}
	err := b.Grow(1)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeTooManyRequests || !strings.Contains(pe.Message, "stay extracted") || !strings.Contains(pe.Message, "512 KiB for one org") {
		t.Fatalf("past the org's share: %v, want too_many_requests naming the budget and what stays", err)
	}
	// Another org can.
	other := &opMemory{budget: budget, org: "b"}
	if err := other.Grow(dpOpMemoryGrain); err != nil {
		t.Fatalf("another org: %v", err)
	}
	a.Shrink(7 * dpOpMemoryGrain)
	if _, org := budget.inUse("a"); org != 2*dpOpMemoryGrain {
		t.Fatalf("after shrinking to 10 bytes the org holds %d, want one grain and one spare", org)
	}
	a.free()
	other.free()
	b.free()
	if all, _ := budget.inUse(""); all != 0 {
		t.Fatalf("after free the budget holds %d", all)
	}
	if err := a.Grow(1); err == nil {
		t.Fatal("an account freed took more")
	}
	a.Shrink(5) // after free: nothing to give back, and no underflow
	if all, _ := budget.inUse(""); all != 0 {
		t.Fatalf("a Shrink after free moved the budget to %d", all)
	}
}

// A request that alone needs more than its org's share can never be served, whatever else ends:
// its refusal says so and to ask for less, instead of to retry (a changes over a baseline record of
// tens of MiB, an ls of a directory of a few hundred thousand long names).
func TestOpMemoryRefusalOfARequestOverTheShareSaysToAskForLess(t *testing.T) {
	budget := newQuota(16*dpOpMemoryGrain, 8*dpOpMemoryGrain)
	a := &opMemory{budget: budget, org: "a"}
	defer a.free()
	if err := a.Grow(dpOpMemoryGrain); err != nil {
		t.Fatal(err)
	}
	err := a.Grow(8 * dpOpMemoryGrain)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeTooManyRequests {
		t.Fatalf("a request over its org's share: %v, want too_many_requests", err)
	}
	if strings.Contains(pe.Message, "Retry") || !strings.Contains(pe.Message, "alone") || !strings.Contains(pe.Message, "ask for less") {
		t.Fatalf("the refusal of a request over its org's share says %q: want that it alone is over the share and to ask for less, not to retry", pe.Message)
	}
	if all, _ := budget.inUse(""); all != dpOpMemoryGrain {
		t.Fatalf("a refused growth moved the budget to %d, want the grain taken before it", all)
	}
}
