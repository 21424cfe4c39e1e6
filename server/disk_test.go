package server_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server/servertest"
)

// One sandbox filling its disk quota gets ENOSPC inside, and the broker keeps serving: a dataplane
// write into another sandbox, another sandbox's commands and a file in the data dir all work. Its
// files survive a stop and resume, and delete leaves no mount behind.
func TestDiskQuotaOverTheDataplane(t *testing.T) {
	t.Parallel()
	tmpl := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"small":   {Name: "small", Disk: 16 << 20},
	}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl})
	ctx := t.Context()
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "full", Template: "small"}); err != nil {
		t.Fatal(err)
	}
	scopes := protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}}
	full, m := dialToken(t, b, "full", scopes)
	other, _ := dialToken(t, b, "other", scopes)

	res, err := full.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo kept > kept; dd if=/dev/zero of=big bs=1M count=64", Combined: true}})
	if err != nil || res.ExitCode == 0 || res.Output == nil || !strings.Contains(*res.Output, "No space left") {
		t.Fatalf("64 MiB into a 16 MiB sandbox: %v %+v; want ENOSPC", err, res)
	}
	if _, err := other.Write(ctx, protocol.WriteArgs{Path: "/workspace/a.txt", Content: strings.Repeat("x", 1<<20)}); err != nil {
		t.Fatalf("a dataplane write into another sandbox: %v", err)
	}
	res, err = other.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "wc -c < a.txt", Combined: true}})
	if err != nil || res.ExitCode != 0 || res.Output == nil || strings.TrimSpace(*res.Output) != "1048576" {
		t.Fatalf("another sandbox's command: %v %+v", err, res)
	}
	if err := os.WriteFile(filepath.Join(b.DataDir, "broker-write"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatalf("a write in the data dir: %v", err)
	}

	if _, err := b.Client.StopSandbox(ctx, "full"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.ResumeSandbox(ctx, "full"); err != nil {
		t.Fatal(err)
	}
	full2, _ := dialToken(t, b, "full", scopes)
	rr, err := full2.Read(ctx, protocol.ReadArgs{Path: "kept"})
	if err != nil || rr.Content != "kept\n" {
		t.Fatalf("after stop and resume: %v %+v", err, rr)
	}
	if _, err := b.Client.DeleteSandbox(ctx, "full"); err != nil {
		t.Fatal(err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), m.Sandbox.SandboxID) {
		t.Fatalf("a mount of %s is left after delete", m.Sandbox.SandboxID)
	}
	if _, err := os.Stat(filepath.Join(b.DataDir, "sandboxes", m.Sandbox.SandboxID)); !os.IsNotExist(err) {
		t.Fatalf("the sandbox's files after delete: %v", err)
	}
}

// A sandbox that filled its disk quota still loses its lease on time: the sweep warns, then stops it
// (ttl_expired), and its files are kept.
func TestFullDiskLeaseExpiresOnTime(t *testing.T) {
	t.Parallel()
	clock := servertest.NewClock(time.Now())
	tmpl := map[string]provider.Template{
		"default": provider.DefaultTemplate(),
		"small":   {Name: "small", Disk: 16 << 20},
	}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl, Now: clock.Now})
	ctx := t.Context()
	ttl := int64(2)
	if _, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "full", Template: "small", TTLSeconds: &ttl}); err != nil {
		t.Fatal(err)
	}
	full, _ := dialToken(t, b, "full", protocol.MintRequest{Scopes: []string{"fs:read", "exec"}})
	res, err := full.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo kept > kept; dd if=/dev/zero of=big bs=1M count=64", Combined: true}})
	if err != nil || res.Output == nil || !strings.Contains(*res.Output, "No space left") {
		t.Fatalf("filling the disk: %v %+v", err, res)
	}
	clock.Advance(1500 * time.Millisecond)
	if r, err := b.Sweeper.SweepOnce(ctx); err != nil || r.Warned != 1 {
		t.Fatalf("first sweep: %+v %v", r, err)
	}
	clock.Advance(time.Second)
	if r, err := b.Sweeper.SweepOnce(ctx); err != nil || r.Stopped != 1 {
		t.Fatalf("second sweep: %+v %v", r, err)
	}
	got, err := b.Client.GetSandbox(ctx, "full")
	if err != nil || got.Status != protocol.StatusStopped || got.StopReason != protocol.StopTTLExpired {
		t.Fatalf("after the lease: %v %+v", err, got)
	}
	if _, err := b.Client.ResumeSandbox(ctx, "full"); err != nil {
		t.Fatal(err)
	}
	again, _ := dialToken(t, b, "full", protocol.MintRequest{Scopes: []string{"fs:read"}})
	if rr, err := again.Read(ctx, protocol.ReadArgs{Path: "kept"}); err != nil || rr.Content != "kept\n" {
		t.Fatalf("files after the ttl stop: %v %+v", err, rr)
	}
}
