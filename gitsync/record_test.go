package gitsync

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/baseline"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func TestMain(m *testing.M) { servertest.Main(m) }

// TestOversizedRecordStopsTheDownload: a baseline record over baseline.MaxRecordBytes is damaged
// as soon as that much has arrived, and its download ends there. The sandbox chooses the record:
// a sparse terabyte made push, which had stopped keeping the bytes, still wait while the broker
// read and sent all of them (a write error of the sink only discards the rest).
func TestOversizedRecordStopsTheDownload(t *testing.T) {
	b := servertest.New(t, servertest.Options{})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "rec"}); err != nil {
		t.Fatal(err)
	}
	m, err := b.Client.Delegate(t.Context(), "rec", protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		t.Fatal(err)
	}
	be, err := backend.FromRunConfig(t.Context(), map[string]any{"sandbox": m.Sandbox}, backend.RunConfigOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dp := be.(*backend.Remote)
	defer dp.Close()
	if res, err := dp.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "mkdir -p .sbx && truncate -s 1T .sbx/baseline"}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("making a sparse terabyte record: %+v %v", res, err)
	}
	// Sending a terabyte takes far longer than this bound; stopping at 64 MiB takes well under it.
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	_, ok, err := readRecord(ctx, dp)
	if !ok || !errors.Is(err, baseline.ErrDamaged) {
		t.Fatalf("a terabyte record: ok %v, err %v; want it damaged once 64 MiB arrived", ok, err)
	}
	// The connection is still good for the next request.
	if _, err := dp.Stat(t.Context(), RecordPath); err != nil {
		t.Fatalf("stat after the refused record: %v", err)
	}
}
