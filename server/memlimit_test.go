package server_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// A sandbox whose /tmp and /dev/shm fill its memory limit (nothing could run in it any more) is
// stopped with reason memory_limit and a stopped event saying so; the exec that filled it answers
// rather than hang, and the sandbox resumes with its files.
func TestMemoryLimitStopsTheSandbox(t *testing.T) {
	t.Parallel()
	tmpl := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"tight":   {Name: "tight", Limits: provider.Limits{MemoryBytes: 64 << 20}, Tmp: 48 << 20},
	}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "tight", Template: "tight"}); err != nil {
		t.Fatal(err)
	}
	r, m := dialToken(t, b, "tight", protocol.MintRequest{Scopes: []string{"fs:read", "exec"}})
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{
		Command: "echo kept > kept; head -c 40M /dev/zero > /dev/shm/a; head -c 40M /dev/zero > /tmp/b; sleep 30"}})
	var pe *protocol.Error
	switch {
	case err == nil && res.Reason == "memory_limit":
	case errors.As(err, &pe) && pe.Code == protocol.CodeNotRunning:
	default:
		t.Fatalf("the exec that filled memory: %v %+v, want memory_limit or not_running", err, res)
	}
	if err := wait.For(10*time.Second, func() error {
		got, err := b.Client.GetSandbox(ctx, "tight")
		if err == nil && (got.Status != protocol.StatusStopped || got.StopReason != protocol.StopMemoryLimit) {
			err = fmt.Errorf("status %s (%s)", got.Status, got.StopReason)
		}
		return err
	}); err != nil {
		t.Fatalf("the sandbox was not stopped for memory_limit: %v", err)
	}
	// The event is written after the record changes (the emitter does not hold up the stop): wait for it.
	if err := wait.For(5*time.Second, func() error {
		var stopped bool
		if err := b.Client.Events(ctx, client.EventOptions{Ref: m.Sandbox.SandboxID, Backlog: 100}, func(e protocol.Event) error {
			stopped = stopped || e.Type == protocol.EventStopped && e.Reason == protocol.StopMemoryLimit
			return nil
		}); err != nil {
			return err
		}
		if !stopped {
			return fmt.Errorf("no stopped event with reason memory_limit")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	if _, err := b.Client.ResumeSandbox(ctx, "tight"); err != nil {
		t.Fatal(err)
	}
	r2, _ := dialToken(t, b, "tight", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if rr, err := r2.Read(ctx, protocol.ReadArgs{Path: "kept"}); err != nil || rr.Content != "kept\n" {
		t.Fatalf("after resume: %v %+v", err, rr)
	}
}
