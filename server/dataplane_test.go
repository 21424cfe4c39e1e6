package server_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func dialToken(t *testing.T, b *servertest.Broker, name string, req protocol.MintRequest) (*backend.Remote, protocol.MintResponse) {
	t.Helper()
	b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name})
	m, err := b.Client.Delegate(t.Context(), name, req)
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token, SandboxID: m.Sandbox.SandboxID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, m
}

func TestDataplaneSmoke(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	r, _ := dialToken(t, b, "dp", protocol.MintRequest{Scopes: []string{"fs:read", "fs:write", "exec"}})
	ctx := t.Context()
	if err := r.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Write(ctx, protocol.WriteArgs{Path: "/workspace/a.txt", Content: "hello\nworld\n"}); err != nil {
		t.Fatal(err)
	}
	rr, err := r.Read(ctx, protocol.ReadArgs{Path: "a.txt", LineOffset: 1, LineLimit: 1})
	if err != nil || rr.Content != "world\n" || rr.TotalLines != 2 {
		t.Fatalf("read: %v %+v", err, rr)
	}
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "cat a.txt; echo err >&2; exit 3", Combined: true}})
	if err != nil || res.ExitCode != 3 || res.Output == nil || *res.Output != "hello\nworld\nerr\n" {
		t.Fatalf("exec: %v %+v", err, res)
	}
	var out bytes.Buffer
	res, err = r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo streamed"}, Stdout: &out})
	if err != nil || out.String() != "streamed\n" {
		t.Fatalf("stream: %v %+v %q", err, res, out.String())
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 300000) // 4.8 MB: several chunks
	if w, err := r.Upload(ctx, "big.bin", bytes.NewReader(big)); err != nil || w.Size != int64(len(big)) {
		t.Fatalf("upload: %v %+v", err, w)
	}
	var got bytes.Buffer
	if n, err := r.Download(ctx, "big.bin", &got); err != nil || n != int64(len(big)) || !bytes.Equal(got.Bytes(), big) {
		t.Fatalf("download: %v %d", err, n)
	}
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := r.Exec(cctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "sleep 30"}}); err == nil || time.Since(start) > 5*time.Second {
		t.Fatalf("cancel: %v after %s", err, time.Since(start))
	}
	if err := r.Ping(ctx); err != nil {
		t.Fatalf("connection unusable after a cancel: %v", err)
	}
	if _, err := r.Read(ctx, protocol.ReadArgs{Path: "../etc/passwd"}); !strings.Contains(code(err), "invalid_path") {
		t.Fatalf("escape: %v", err)
	}
}
