package workspace

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/sbxbroker/broker/membudget"
	"github.com/sbxbroker/broker/membudget/membudgettest"
	"github.com/sbxbroker/broker/protocol"
)

// TestOperationsDrawOnTheCallersBudget: ls, glob, grep and edit draw what they build (names,
// answers, a file's content) from the budget the caller puts in the context, which the broker
// shares between every request; past it each stops with the budget's own error, and a refused
// edit leaves the file as it was.
func TestOperationsDrawOnTheCallersBudget(t *testing.T) {
	w, dir := newWS(t, Options{})
	for i := range 50 {
		put(t, dir, fmt.Sprintf("d/f%02d.txt", i), "needle\n")
	}
	ops := map[string]func(ctx context.Context) error{
		"ls": func(ctx context.Context) error { _, err := w.ListContext(ctx, "d"); return err },
		"glob": func(ctx context.Context) error {
			_, err := w.GlobContext(ctx, protocol.GlobArgs{Pattern: "**/*.txt"})
			return err
		},
		"grep": func(ctx context.Context) error {
			_, err := w.Grep(ctx, protocol.GrepArgs{Pattern: "needle"})
			return err
		},
		"edit": func(ctx context.Context) error {
			_, err := w.EditContext(ctx, protocol.EditArgs{Path: "d/f00.txt", Old: "needle", New: "pin"})
			return err
		},
	}
	for name, run := range ops {
		spent := &membudgettest.Meter{Limit: 1}
		if err := run(membudget.With(t.Context(), spent)); !errors.Is(err, membudgettest.ErrSpent) {
			t.Errorf("%s past its caller's budget: %v, want the budget's error", name, err)
		}
	}
	if got := hostRead(t, dir+"/d/f00.txt"); got != "needle\n" {
		t.Fatalf("a refused edit changed the file: %q", got)
	}
	for name, run := range ops {
		b := &membudgettest.Meter{Limit: 1 << 20}
		if err := run(membudget.With(t.Context(), b)); err != nil || b.Held == 0 {
			t.Errorf("%s within its caller's budget: %v, drew %d", name, err, b.Held)
		}
	}
}
