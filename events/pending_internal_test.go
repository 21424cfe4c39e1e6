package events

import (
	"fmt"
	"log/slog"
	"slices"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// The outage buffer's share rule, step by step: an org within its share pushes out the newest
// events of the org that holds the most; each org's stream then reads its kept events, its gap, and
// what came after, in order.
func TestPendingSharesTheBuffer(t *testing.T) {
	p := newPending(slog.New(slog.DiscardHandler), 8)
	ev := func(org string, i int) queued {
		return queued{org: org, e: protocol.Event{Type: protocol.EventExec, SandboxID: "sb_" + org, Command: fmt.Sprint(i)}}
	}
	for i := range 10 {
		p.add(ev("a", i)) // 0..7 kept, 8 and 9 lost
	}
	for i := range 3 {
		p.add(ev("b", i)) // 0 and 1 push out a's 7 and 6; 2 is past b's share (2)
	}
	p.add(ev("a", 10)) // a is losing: counted into its gap
	p.compact()
	var got []string
	for _, q := range p.events {
		got = append(got, q.org+q.e.Command)
	}
	if want := []string{"a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"}; !slices.Equal(got, want) {
		t.Fatalf("kept %v, want %v", got, want)
	}
	if a, b := p.lost[lostKey{"a", "sb_a", ""}], p.lost[lostKey{"b", "sb_b", ""}]; a != 5 || b != 1 {
		t.Fatalf("lost a %d, b %d; want 5 and 1", a, b)
	}
	// A write takes everything: the gaps go in, then each org keeps again, and a later squeeze
	// pushes out a's newest event, never one older than what it keeps.
	p.events = p.events[:0]
	p.recount()
	p.settle()
	for i := 11; i < 17; i++ {
		p.add(ev("a", i))
	}
	p.add(ev("b", 3))
	p.compact()
	got = got[:0]
	for _, q := range p.events {
		s := q.org + q.e.Command
		if q.e.Type == protocol.EventGap {
			s = fmt.Sprintf("%s-gap%d", q.org, *q.e.Missed)
		}
		got = append(got, s)
	}
	if want := []string{"a-gap5", "b-gap1", "a11", "a12", "a13", "a14", "a15", "b3"}; !slices.Equal(got, want) {
		t.Fatalf("after the write: %v, want %v", got, want)
	}
	if n := p.lost[lostKey{"a", "sb_a", ""}]; n != 1 {
		t.Fatalf("a lost %d after the write, want 1 (its 16)", n)
	}
}

// An org whose share is all gap events (it lost events on many sandboxes, and the gaps went in)
// holds the most but has nothing to push out: the org past its share that holds ordinary events
// makes the room instead. Before, the eviction looked only at the org holding the most, found
// nothing to take, and the org within its share lost its event to a buffer another org overfilled.
func TestPendingEvictsPastAnOrgOfGaps(t *testing.T) {
	p := newPending(slog.New(slog.DiscardHandler), 20)
	for i := range 9 {
		p.lose(lostKey{"g", fmt.Sprint("sb_g", i), ""}, 1)
	}
	p.settle() // g holds 9 gap events
	for i := range 8 {
		p.add(queued{org: "b", e: protocol.Event{Type: protocol.EventExec, SandboxID: "sb_b", Command: fmt.Sprint(i)}})
	}
	for i := range 3 {
		p.add(queued{org: "c", e: protocol.Event{Type: protocol.EventExec, SandboxID: "sb_c", Command: fmt.Sprint(i)}})
	}
	if p.live != p.max {
		t.Fatalf("%d live events, want the buffer (%d) full", p.live, p.max)
	}
	p.add(queued{org: "c", e: protocol.Event{Type: protocol.EventExec, SandboxID: "sb_c", Command: "3"}})
	if n := p.lost[lostKey{"c", "sb_c", ""}]; n != 0 {
		t.Fatalf("c, within its share (3 of 5), lost %d events while b holds 8", n)
	}
	if n := p.lost[lostKey{"b", "sb_b", ""}]; n != 1 {
		t.Fatalf("b, past its share, lost %d events, want its newest", n)
	}
	p.compact()
	last := p.events[len(p.events)-1]
	if last.org != "c" || last.e.Command != "3" {
		t.Fatalf("the newest event kept: %+v, want c's 3", last)
	}
	for _, q := range p.events {
		if q.org == "b" && q.e.Command == "7" {
			t.Fatalf("b's newest event (7) is still kept: %+v", p.events)
		}
	}
}
