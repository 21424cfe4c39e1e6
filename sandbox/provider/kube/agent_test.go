package kube

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/sandbox/provider/agent"
)

// testCredentials is a sandbox's TLS certificate and key (PEM) and the broker's TLS pinning it.
func testCredentials(t *testing.T) (cert, key []byte, pin *tls.Config) {
	t.Helper()
	cert, key, err := agent.NewCredentials()
	if err != nil {
		t.Fatal(err)
	}
	if pin, err = agent.ClientTLS(cert); err != nil {
		t.Fatal(err)
	}
	return cert, key, pin
}

// agentInstance serves a temporary workspace with the real agent on loopback and returns an
// instance reaching it as the provider reaches a pod's (no cluster: the pod network is replaced by
// loopback, nothing else).
func agentInstance(t *testing.T, secret string) (*instance, string) {
	t.Helper()
	dir := t.TempDir()
	cert, key, pin := testCredentials(t)
	srv, err := agent.NewServer(agent.Config{Secret: []byte("the-pods-secret-0123456789"), Workspace: dir,
		Env: []string{"PATH=/usr/bin:/bin", "FROM=agent"}, Cert: cert, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go srv.Serve(ln)
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: ln.Addr().String(), secret: []byte(secret), tls: pin, gone: in.goneErr}
	t.Cleanup(in.client.close)
	return in, dir
}

func TestAgentExec(t *testing.T) {
	in, dir := agentInstance(t, "the-pods-secret-0123456789")
	ctx := context.Background()
	if err := in.connect(ctx); err != nil {
		t.Fatal(err)
	}
	if in.Environment()["FROM"] != "agent" {
		t.Errorf("environment snapshot %v", in.Environment())
	}
	run := func(req provider.ExecRequest) (provider.ExecResult, string, string) {
		t.Helper()
		var out, errOut bytes.Buffer
		req.Stdout = &out
		if req.Stderr == nil {
			req.Stderr = &errOut
		}
		res, err := in.Exec(ctx, req)
		if err != nil {
			t.Fatalf("exec %q: %v", req.Command, err)
		}
		return res, out.String(), errOut.String()
	}
	res, out, errs := run(provider.ExecRequest{Command: `echo "$FROM $X $(pwd)"; echo oops >&2; exit 3`, Env: map[string]string{"X": "y"}})
	// The agent's workspace here is a temp dir (in a pod it is /workspace itself).
	if res.ExitCode != 3 || out != "agent y "+dir+"\n" || errs != "oops\n" {
		t.Errorf("exit %d stdout %q stderr %q, want 3, %q and oops", res.ExitCode, out, errs, "agent y "+dir)
	}
	res, out, _ = run(provider.ExecRequest{Argv: []string{"cat"}, Cwd: "/workspace", Stdin: strings.NewReader("from stdin"), Timeout: 10 * time.Second})
	_ = res
	if out != "from stdin" {
		t.Errorf("stdin round trip %q", out)
	}
	res, out, _ = run(provider.ExecRequest{Command: "yes | head -c 100000", MaxOutput: 10})
	if out != "y\ny\ny\ny\ny\n" || !res.Truncated {
		t.Errorf("capped output %q truncated %v", out, res.Truncated)
	}
	res, _, _ = run(provider.ExecRequest{Command: "sleep 30", Timeout: 200 * time.Millisecond})
	if res.Reason != provider.ReasonTimeout || res.Signal != "KILL" || res.ExitCode != 137 {
		t.Errorf("timeout: %+v", res)
	}
	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(200*time.Millisecond, cancel)
	r2, err := in.Exec(cctx, provider.ExecRequest{Command: "sleep 30", Stdout: io.Discard})
	if err != nil || r2.Reason != provider.ReasonCancelled {
		t.Errorf("cancelled: %+v %v", r2, err)
	}
	res, _, errs = run(provider.ExecRequest{Argv: []string{"no-such-program"}})
	if res.ExitCode != 127 || !strings.Contains(errs, "command not found") {
		t.Errorf("missing program: %+v %q", res, errs)
	}
	bg, err := in.Exec(ctx, provider.ExecRequest{Command: "sleep 1", Background: true})
	if err != nil || bg.Pid == 0 {
		t.Errorf("background: %+v %v", bg, err)
	}
	_, err = in.Exec(ctx, provider.ExecRequest{Command: "true", Cwd: "/elsewhere"})
	var ire *provider.InvalidRequestError
	if !errors.As(err, &ire) {
		t.Errorf("cwd outside the workspace: %v, want an invalid request", err)
	}
	// A missing cwd says what to do, as the other providers' do.
	_, err = in.Exec(ctx, provider.ExecRequest{Command: "true", Cwd: "/workspace/missing"})
	if !errors.As(err, &ire) || !strings.Contains(err.Error(), "create it first") {
		t.Errorf("a missing cwd: %v, want an invalid request saying to create it", err)
	}
}

func TestAgentRefusesAWrongSecret(t *testing.T) {
	in, _ := agentInstance(t, "not-the-pods-secret-at-all")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var env []string
	if err := in.client.unary(ctx, agent.OpEnv, nil, &env); err == nil || len(env) > 0 {
		t.Fatalf("a wrong secret got %v, %v", env, err)
	}
	if _, err := in.Exec(ctx, provider.ExecRequest{Command: "true"}); err == nil {
		t.Fatal("a wrong secret ran a command")
	}
}

func TestAgentFiles(t *testing.T) {
	in, dir := agentInstance(t, "the-pods-secret-0123456789")
	f := in.Files()
	ctx := context.Background()
	if _, err := f.Write(protocol.WriteArgs{Path: "/workspace/a/b.txt", Content: "hello"}); err != nil {
		t.Fatal(err)
	}
	got, err := f.ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/a/b.txt"})
	if err != nil || got.Content != "hello" {
		t.Fatalf("read %+v %v", got, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "a/b.txt")); string(b) != "hello" {
		t.Errorf("on disk %q", b)
	}
	ls, err := f.ListContext(ctx, "/workspace/a")
	if err != nil || len(ls.Entries) != 1 || ls.Entries[0].Name != "b.txt" {
		t.Errorf("ls %+v %v", ls, err)
	}
	_, err = f.ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/missing"})
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Code != protocol.CodeFileNotFound {
		t.Errorf("missing file: %v, want a file_not_found protocol error", err)
	}
	_, err = f.Stat("/workspace/../etc/passwd")
	if !errors.As(err, &pe) {
		t.Errorf("escape: %v, want a protocol error", err)
	}
	up, err := f.Create("/workspace/big", protocol.WriteOverwrite)
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	if _, err := up.Write(big); err != nil {
		t.Fatal(err)
	}
	if _, err := up.Commit(); err != nil {
		t.Fatal(err)
	}
	rc, info, err := f.OpenRead("/workspace/big")
	if err != nil || info.Size != int64(len(big)) {
		t.Fatalf("open %+v %v", info, err)
	}
	back, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(back, big) {
		t.Errorf("download: %d bytes, %v", len(back), err)
	}
	var tb bytes.Buffer
	if _, err := f.Archive(ctx, "/workspace/a", &tb); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Extract(ctx, "/workspace/copy", bytes.NewReader(tb.Bytes())); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "copy/a/b.txt")); string(b) != "hello" {
		names := []string{}
		tr := tar.NewReader(bytes.NewReader(tb.Bytes()))
		for h, err := tr.Next(); err == nil; h, err = tr.Next() {
			names = append(names, h.Name)
		}
		t.Errorf("extracted copy/a/b.txt = %q (archive held %v)", b, names)
	}
}

// TestAgentClientRefusesAnImpostor: whatever listens at a pod's address (another pod given the IP
// of one that went, say) must prove it holds the sandbox's secret before the broker sends it a
// request; one that answers the handshake without it gets nothing, and the broker's own answer
// to its challenge cannot serve as that proof.
func TestAgentClientRefusesAnImpostor(t *testing.T) {
	// It holds no key for the pinned certificate, so it cannot even take TLS: it is given its own,
	// and the broker pins the sandbox's.
	cert, key, _ := testCredentials(t)
	_, _, pin := testCredentials(t)
	got := make(chan []byte, 8)
	addr := fakeAgent(t, cert, key, func(nc net.Conn) {
		challenge := bytes.Repeat([]byte{7}, agent.ChallengeSize)
		nc.Write(challenge)
		hs := make([]byte, 2*agent.ChallengeSize)
		n, _ := io.ReadAtLeast(nc, hs, agent.ChallengeSize)
		// Reflect what the broker sent as the proof: its own answer, or its challenge.
		nc.Write(hs[:agent.ChallengeSize])
		if n >= 2*agent.ChallengeSize {
			nc.Write(hs[agent.ChallengeSize:])
		}
		nc.SetReadDeadline(time.Now().Add(2 * time.Second))
		rest, _ := io.ReadAll(nc)
		got <- rest
	})
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: addr, secret: []byte("the-pods-secret-0123456789"), tls: pin, gone: in.goneErr}
	defer in.client.close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := in.Exec(ctx, provider.ExecRequest{Command: "echo secret-data > /workspace/x"}); err == nil {
		t.Fatal("an impostor agent ran a command")
	}
	select {
	case rest := <-got:
		if bytes.Contains(rest, []byte("secret-data")) {
			t.Fatalf("the broker sent its request to an impostor: %q", rest)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the broker never reached the impostor")
	}
}

// TestAgentHandshakeFloodLeavesTheBrokerIn: anything on the pod network that can reach the agent's
// port (a NetworkPolicy is only as good as the cluster's CNI) may open connections and never answer
// the challenge. The agent must hold only a bounded number of them, dropping the oldest, so such a
// flood neither grows the agent's memory and fds nor keeps the broker out.
func TestAgentHandshakeFloodLeavesTheBrokerIn(t *testing.T) {
	in, _ := agentInstance(t, "the-pods-secret-0123456789")
	const flood = 1000
	closed := make(chan struct{}, flood)
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	// From another pod's address: the broker's own is not the flood's.
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	for range flood {
		c, err := d.Dial("tcp", in.client.addr)
		if err != nil {
			t.Fatalf("dial %d: %v", len(conns), err)
		}
		conns = append(conns, c)
		go func() {
			// Read the challenge, answer nothing, and report when the agent lets go.
			io.Copy(io.Discard, c)
			closed <- struct{}{}
		}()
	}
	// The agent keeps at most agent.MaxPendingHandshakes of them (past its handshake rate for the
	// address, fewer): the rest are closed at once, long before the handshake's own deadline.
	deadline := time.After(5 * time.Second)
	for n := 0; n < flood-agent.MaxPendingHandshakes; n++ {
		select {
		case <-closed:
		case <-deadline:
			t.Fatalf("the agent still holds %d of %d silent connections after 5 s (want at most %d)", flood-n, flood, agent.MaxPendingHandshakes)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var out bytes.Buffer
	res, err := in.Exec(ctx, provider.ExecRequest{Command: "echo through", Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "through\n" {
		t.Fatalf("the broker during a handshake flood: %v %+v %q", err, res, out.String())
	}
}

// cutFirst is a listener whose first connection is closed in the middle of its handshake, as the
// agent drops the oldest pending handshake past its bound.
type cutFirst struct {
	net.Listener
	once sync.Once
}

func (l *cutFirst) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cut := false
		l.once.Do(func() { cut = true })
		if !cut {
			return c, nil
		}
		io.ReadAtLeast(c, make([]byte, 512), 1) // the broker's TLS hello, never answered
		c.Close()
	}
}

// TestAgentClientRetriesACutHandshake: a connection the agent closes during the handshake (one of
// the broker's own, dropped in a burst past the agent's bound) is dialled again, so the exec runs.
func TestAgentClientRetriesACutHandshake(t *testing.T) {
	cert, key, pin := testCredentials(t)
	srv, err := agent.NewServer(agent.Config{Secret: []byte("the-pods-secret-0123456789"), Workspace: t.TempDir(), Env: []string{"PATH=/usr/bin:/bin"}, Cert: cert, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go srv.Serve(&cutFirst{Listener: ln})
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: ln.Addr().String(), secret: []byte("the-pods-secret-0123456789"), tls: pin, gone: in.goneErr}
	t.Cleanup(in.client.close)
	var out bytes.Buffer
	res, err := in.Exec(context.Background(), provider.ExecRequest{Command: "echo again", Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "again\n" {
		t.Fatalf("exec after a cut handshake: %v %+v %q", err, res, out.String())
	}
}

// TestAgentChannelIsTLS: the agent speaks only TLS 1.3: a peer in clear (the agent protocol's own
// handshake, as an older broker or another pod would start it) gets no challenge, nothing but
// TLS's alert, and the connection ends; a broker pinning another certificate refuses the real
// agent and sends it nothing; an agent in clear (an image older than TLS) is refused by name.
func TestAgentChannelIsTLS(t *testing.T) {
	in, dir := agentInstance(t, "the-pods-secret-0123456789")
	nc, err := net.Dial("tcp", in.client.addr)
	if err != nil {
		t.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(10 * time.Second))
	nc.Write(make([]byte, 2*agent.ChallengeSize)) // an answer and a challenge, in clear
	got, err := io.ReadAll(nc)
	nc.Close()
	if err != nil || len(got) >= agent.ChallengeSize || len(got) > 0 && got[0] != 0x15 {
		t.Fatalf("a peer in clear got %d bytes %x (%v), want at most a TLS alert and the end", len(got), got, err)
	}

	// The real agent, its sandbox's certificate not the one pinned.
	_, _, other := testCredentials(t)
	wrong := &instance{name: "wrong-pin", done: make(chan struct{})}
	wrong.client = &agentClient{addr: in.client.addr, secret: in.client.secret, tls: other, gone: wrong.goneErr}
	defer wrong.client.close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = wrong.Exec(ctx, provider.ExecRequest{Command: "touch /workspace/ran"})
	if err == nil || !strings.Contains(err.Error(), "did not present the sandbox's agent certificate") {
		t.Fatalf("a broker pinning another certificate: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "ran")); err == nil {
		t.Fatal("the agent ran a command for a broker that refused its certificate")
	}

	// An agent in clear, as sbx-agent was before TLS: it greets with its challenge.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write(make([]byte, agent.ChallengeSize))
			go func() { io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	old := &instance{name: "old", done: make(chan struct{})}
	old.client = &agentClient{addr: ln.Addr().String(), secret: in.client.secret, tls: in.client.tls, gone: old.goneErr}
	defer old.client.close()
	if _, err := old.Exec(ctx, provider.ExecRequest{Command: "true"}); err == nil || !strings.Contains(err.Error(), "does not speak TLS") {
		t.Fatalf("an agent in clear: %v", err)
	}
	// And nothing at all without a pin: never in clear.
	none := &agentClient{addr: in.client.addr, secret: in.client.secret}
	if _, err := none.dial(ctx); err == nil {
		t.Fatal("a client without a pinned certificate dialled")
	}
	if _, err := agent.NewServer(agent.Config{Secret: []byte("the-pods-secret-0123456789"), Workspace: dir}); err == nil || !strings.Contains(err.Error(), "does not serve in clear") {
		t.Fatalf("an agent without a certificate: %v", err)
	}
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	mu sync.Mutex
	n  int
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.n++
		l.mu.Unlock()
	}
	return c, err
}

func (l *countingListener) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n
}

// TestAgentUploadKeepsItsConnection: the dataplane's every write is an upload (Create, Write,
// Commit); one that ended in step with the agent (committed, refused at its commit, or aborted)
// leaves its connection to the next operation, instead of costing the next one a TCP connect, a
// TLS handshake and the secret's challenges (a pod's 4 KiB write then read was ~1 ms slower for
// it). The connections are the uploads' first and the one spare dialled beside it.
func TestAgentUploadKeepsItsConnection(t *testing.T) {
	cert, key, pin := testCredentials(t)
	dir := t.TempDir()
	srv, err := agent.NewServer(agent.Config{Secret: []byte("the-pods-secret-0123456789"), Workspace: dir, Env: []string{"PATH=/usr/bin:/bin"}, Cert: cert, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	cl := &countingListener{Listener: ln}
	go srv.Serve(cl)
	in := &instance{name: "test", done: make(chan struct{})}
	in.client = &agentClient{addr: ln.Addr().String(), secret: []byte("the-pods-secret-0123456789"), tls: pin, gone: in.goneErr}
	t.Cleanup(in.client.close)
	f := in.Files()
	ctx := context.Background()
	upload := func(path, mode, content string) error {
		up, err := f.Create(path, mode)
		if err != nil {
			return err
		}
		if _, err := up.Write([]byte(content)); err != nil {
			return err
		}
		_, err = up.Commit()
		return err
	}
	for i := range 5 {
		content := strings.Repeat(string(rune('a'+i)), 4096)
		if err := upload("/workspace/4k", protocol.WriteOverwrite, content); err != nil {
			t.Fatalf("upload %d: %v", i, err)
		}
		got, err := f.ReadContext(ctx, protocol.ReadArgs{Path: "/workspace/4k"})
		if err != nil || got.Content != content {
			t.Fatalf("read after upload %d: %d bytes, %v", i, len(got.Content), err)
		}
	}
	// Refused at its commit: the agent's answer, in step.
	up, err := f.Create("/workspace/late", protocol.WriteCreate)
	if err != nil {
		t.Fatal(err)
	}
	if err := upload("/workspace/late", protocol.WriteOverwrite, "first"); err != nil {
		t.Fatal(err)
	}
	up.Write([]byte("second"))
	var pe *protocol.Error
	if _, err := up.Commit(); !errors.As(err, &pe) || pe.Code != protocol.CodeFileExists {
		t.Fatalf("commit over a file written meanwhile: %v, want file_exists", err)
	}
	// Aborted.
	up, err = f.Create("/workspace/never", protocol.WriteOverwrite)
	if err != nil {
		t.Fatal(err)
	}
	up.Write([]byte("x"))
	if err := up.Abort(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Stat("/workspace/never"); !errors.As(err, &pe) || pe.Code != protocol.CodeFileNotFound {
		t.Errorf("an aborted upload's file: %v, want file_not_found", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "late")); string(b) != "first" {
		t.Errorf("late = %q, want the first upload's", b)
	}
	if n := cl.count(); n > 3 {
		t.Errorf("the agent accepted %d connections for 8 uploads and their reads, want the first, its spare, and the second upload's own at most", n)
	}
}
