package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/server"
	"github.com/sbxbroker/broker/server/servertest"
	"github.com/sbxbroker/broker/tests/wait"
)

// The upload door (PUT .../dataplane/upload) as a hostile delegate would try it: written by hand,
// not through the Go client, so nothing the client checks first hides a hole in the broker.

// putUpload sends body to the door of sandbox ref on b, with query q and credential cred ("" for
// none), and answers the status and the error code ("" on success, with the result in res).
func putUpload(t *testing.T, b *servertest.Broker, ref, query, cred string, body io.Reader) (status int, code string, res protocol.WriteResult) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPut, b.URL+"/v1/sandboxes/"+ref+"/dataplane/upload?"+query, body)
	if err != nil {
		t.Fatal(err)
	}
	if cred != "" {
		req.Header.Set("Authorization", "Bearer "+cred)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(raw, &res); err != nil {
			t.Fatalf("a 200 whose body is not a result: %s", raw)
		}
		return resp.StatusCode, "", res
	}
	var eb protocol.ErrorBody
	if err := json.Unmarshal(raw, &eb); err != nil || eb.Error.Code == "" {
		t.Fatalf("status %d with a body that is not an error: %s", resp.StatusCode, raw)
	}
	return resp.StatusCode, eb.Error.Code, res
}

func mintFor(t *testing.T, b *servertest.Broker, name string, scopes ...string) protocol.MintResponse {
	t.Helper()
	b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name})
	m, err := b.Client.Delegate(t.Context(), name, protocol.MintRequest{Scopes: scopes})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestUploadPutRefusesWhatTheDataplaneRefuses(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	ctx := t.Context()
	writer := mintFor(t, b, "door", "fs:read", "fs:write")
	id := writer.Sandbox.SandboxID
	ws := workspaceDir(b, id)
	reader := mintFor(t, b, "door", "fs:read", "exec")
	other := mintFor(t, b, "door-other", "fs:read", "fs:write")
	revoked := mintFor(t, b, "door", "fs:write")
	if _, err := b.Client.Revoke(ctx, "door", revoked.JTI); err != nil {
		t.Fatal(err)
	}
	otherOrg := b.NewClient("other-org")
	os.WriteFile(filepath.Join(ws, "kept.txt"), []byte("kept"), 0o644)
	os.Mkdir(filepath.Join(ws, "dir"), 0o755)
	outside := t.TempDir()
	os.Symlink(outside, filepath.Join(ws, "out"))

	q := func(path string) string { return url.Values{"path": {path}}.Encode() }
	cases := []struct {
		name, ref, query, cred string
		status                 int
		code                   string
	}{
		{"no credential", id, q("a.txt"), "", 401, protocol.CodeUnauthenticated},
		{"a token without fs:write", id, q("a.txt"), reader.Token, 403, protocol.CodeScopeDenied},
		{"another sandbox's token", id, q("a.txt"), other.Token, 404, protocol.CodeNotFound},
		{"a revoked token", id, q("a.txt"), revoked.Token, 401, protocol.CodeTokenRevoked},
		{"a token that is not one", id, q("a.txt"), writer.Token[:len(writer.Token)-4] + "AAAA", 401, protocol.CodeTokenSignature},
		{"another org's key", id, q("a.txt"), otherOrg.APIKey(), 404, protocol.CodeNotFound},
		{"the credential in the query", id, q("a.txt") + "&access_token=" + writer.Token, "", 400, protocol.CodeInvalidArgument},
		{"a path given twice", id, q("a.txt") + "&" + q("b.txt"), writer.Token, 400, protocol.CodeInvalidArgument},
		{"no path", id, "", writer.Token, 400, protocol.CodeInvalidPath},
		{"a path out by ..", id, q("../escape.txt"), writer.Token, 400, protocol.CodeInvalidPath},
		{"a path out deeper", id, q("dir/../../escape.txt"), writer.Token, 400, protocol.CodeInvalidPath},
		{"an absolute path outside", id, q("/etc/escape.txt"), writer.Token, 400, protocol.CodeInvalidPath},
		{"a path through a symlink out", id, q("out/escape.txt"), writer.Token, 400, protocol.CodeInvalidPath},
		{"a NUL in the path", id, q("a\x00.txt"), writer.Token, 400, protocol.CodeInvalidPath},
		{"invalid UTF-8", id, "path=a%FF.txt", writer.Token, 400, protocol.CodeInvalidPath},
		{"a directory", id, q("dir"), writer.Token, 400, protocol.CodeIsDirectory},
		{"mode create over a file", id, q("kept.txt") + "&mode=create", writer.Token, 400, protocol.CodeFileExists},
		{"an unknown mode", id, q("a.txt") + "&mode=append", writer.Token, 400, protocol.CodeInvalidArgument},
	}
	for _, c := range cases {
		status, code, _ := putUpload(t, b, c.ref, c.query, c.cred, strings.NewReader("hostile"))
		if status != c.status || code != c.code {
			t.Errorf("%s: %d %s, want %d %s", c.name, status, code, c.status, c.code)
		}
	}
	entries, _ := os.ReadDir(outside)
	if len(entries) != 0 {
		t.Errorf("a file was written outside the workspace: %v", entries)
	}
	for _, p := range []string{"a.txt", "b.txt", "escape.txt", "dir/escape.txt"} {
		if _, err := os.Lstat(filepath.Join(ws, p)); !os.IsNotExist(err) {
			t.Errorf("a refused upload wrote %s: %v", p, err)
		}
	}
	if got, _ := os.ReadFile(filepath.Join(ws, "kept.txt")); string(got) != "kept" {
		t.Errorf("mode create replaced a file: %q", got)
	}
	if left := tempFiles(t, ws); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}

	// A stopped sandbox takes no upload, with its owner's key or a token.
	if _, err := b.Client.StopSandbox(ctx, "door"); err != nil {
		t.Fatal(err)
	}
	for _, cred := range []string{writer.Token, b.Client.APIKey()} {
		if status, code, _ := putUpload(t, b, id, q("a.txt"), cred, strings.NewReader("x")); status != 409 || code != protocol.CodeNotRunning {
			t.Errorf("a stopped sandbox: %d %s", status, code)
		}
	}
}

// The door's upload is the dataplane's: it lands atomically with the mode kept, says created or
// not, and emits file_written naming the token that wrote it.
func TestUploadPutWritesAndEmits(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	m := mintFor(t, b, "door-ok", "fs:read", "fs:write")
	ws := workspaceDir(b, m.Sandbox.SandboxID)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	opened := make(chan struct{})
	found := make(chan protocol.Event, 1)
	go b.Client.Events(ctx, client.EventOptions{Ref: "door-ok", Follow: true, OnOpen: func() { close(opened) }}, func(e protocol.Event) error {
		if e.Type == protocol.EventFileWritten {
			found <- e
			return errors.New("done")
		}
		return nil
	})
	<-opened

	big := bytes.Repeat([]byte("0123456789abcdef"), 3<<16+7) // over 3 MiB, not a whole chunk
	status, code, res := putUpload(t, b, m.Sandbox.SandboxID, "path=/workspace/sub/big.bin", m.Token, bytes.NewReader(big))
	if status != 200 || code != "" || res.Path != "/workspace/sub/big.bin" || res.Size != int64(len(big)) || !res.Created {
		t.Fatalf("upload: %d %s %+v", status, code, res)
	}
	if got, _ := os.ReadFile(filepath.Join(ws, "sub", "big.bin")); !bytes.Equal(got, big) {
		t.Fatalf("the file holds %d bytes, not what was sent", len(got))
	}
	select {
	case e := <-found:
		if e.Path != "/workspace/sub/big.bin" || e.JTI != m.JTI {
			t.Errorf("file_written: %+v", e)
		}
	case <-ctx.Done():
		t.Fatal("no file_written event")
	}

	os.Chmod(filepath.Join(ws, "sub", "big.bin"), 0o600)
	status, _, res = putUpload(t, b, m.Sandbox.SandboxID, "path=sub/big.bin", m.Token, strings.NewReader(""))
	if status != 200 || res.Size != 0 || res.Created {
		t.Fatalf("an empty upload over the file: %d %+v", status, res)
	}
	if fi, err := os.Stat(filepath.Join(ws, "sub", "big.bin")); err != nil || fi.Size() != 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("after the empty upload: %v %v", fi, err)
	}

	// The Go client's Upload takes the door.
	r, err := backend.Dial(ctx, backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if w, err := r.Upload(ctx, "sub/client.bin", io.LimitReader(bytes.NewReader(big), int64(len(big)))); err != nil || w.Size != int64(len(big)) {
		t.Fatalf("client upload: %+v %v", w, err)
	}
	if got, _ := os.ReadFile(filepath.Join(ws, "sub", "client.bin")); !bytes.Equal(got, big) {
		t.Fatalf("the client's file holds %d bytes, not what was sent", len(got))
	}
}

// A body that ends before its Content-Length, or a chunked body with no last chunk, writes
// nothing: the target is untouched, the temporary file goes, and the parents the upload would have
// made are not made.
func TestUploadPutCutBodyWritesNothing(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	m := mintFor(t, b, "door-cut", "fs:write")
	ws := workspaceDir(b, m.Sandbox.SandboxID)
	os.WriteFile(filepath.Join(ws, "target.txt"), []byte("before"), 0o644)
	addr := strings.TrimPrefix(b.URL, "http://")
	for _, head := range []string{
		"Content-Length: " + strconv.Itoa(1<<20) + "\r\n",
		"Transfer-Encoding: chunked\r\n",
	} {
		for _, target := range []string{"target.txt", "new/deep/f.txt"} {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			body := strings.Repeat("cut", 1000)
			if strings.Contains(head, "chunked") {
				body = strconv.FormatInt(int64(len(body)), 16) + "\r\n" + body + "\r\n"
			}
			io.WriteString(c, "PUT /v1/sandboxes/"+m.Sandbox.SandboxID+"/dataplane/upload?path="+target+" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+m.Token+"\r\n"+head+"\r\n"+body)
			// Wait until the broker holds the upload's temporary file, then hang up.
			if !wait.Until(10*time.Second, func() bool { return len(tempFiles(t, ws)) == 1 }) {
				t.Fatalf("%s: the upload never started: %v", head, tempFiles(t, ws))
			}
			c.Close()
			if !wait.Until(10*time.Second, func() bool { return len(tempFiles(t, ws)) == 0 }) {
				t.Errorf("%s: temporary files left after the hang-up: %v", head, tempFiles(t, ws))
			}
			if got, _ := os.ReadFile(filepath.Join(ws, "target.txt")); string(got) != "before" {
				t.Errorf("%s: a cut body replaced the file: %q", head, got)
			}
			if _, err := os.Lstat(filepath.Join(ws, "new")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("%s: a cut upload to %s made its parents: %v", head, target, err)
			}
		}
	}
}

// Revoking the token while its upload runs aborts the upload: the answer says why, and nothing is
// written.
func TestUploadPutAbortedByRevocation(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	m := mintFor(t, b, "door-revoke", "fs:write")
	ws := workspaceDir(b, m.Sandbox.SandboxID)
	pr, pw := io.Pipe()
	defer pw.Close()
	reading := make(chan struct{})
	trace := &httptrace.ClientTrace{Got100Continue: func() { close(reading) }}
	req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), http.MethodPut,
		b.URL+"/v1/sandboxes/"+m.Sandbox.SandboxID+"/dataplane/upload?path=revoked.bin", pr)
	req.Header.Set("Authorization", "Bearer "+m.Token)
	req.Header.Set("Expect", "100-continue")
	tr := &http.Transport{ExpectContinueTimeout: time.Minute}
	defer tr.CloseIdleConnections()
	type answer struct {
		resp *http.Response
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		resp, err := tr.RoundTrip(req)
		answered <- answer{resp, err}
	}()
	// The broker asks for the body once the upload is open.
	<-reading
	go func() {
		chunk := make([]byte, 64<<10)
		for {
			if _, err := pw.Write(chunk); err != nil {
				return
			}
		}
	}()
	if _, err := b.Client.Revoke(t.Context(), "door-revoke", m.JTI); err != nil {
		t.Fatal(err)
	}
	// The broker answers why and closes the connection on the bytes still coming: the client reads
	// the answer, or the reset if it came first.
	a := <-answered
	if a.err == nil {
		var eb protocol.ErrorBody
		json.NewDecoder(a.resp.Body).Decode(&eb)
		a.resp.Body.Close()
		if a.resp.StatusCode != 401 || eb.Error.Code != protocol.CodeTokenRevoked {
			t.Errorf("the revoked upload's answer: %d %+v", a.resp.StatusCode, eb.Error)
		}
	}
	if status, code, _ := putUpload(t, b, m.Sandbox.SandboxID, "path=revoked.bin", m.Token, strings.NewReader("again")); status != 401 || code != protocol.CodeTokenRevoked {
		t.Errorf("an upload after the revocation: %d %s", status, code)
	}
	pw.CloseWithError(errors.New("test over"))
	if !wait.Until(10*time.Second, func() bool { return len(tempFiles(t, ws)) == 0 }) {
		t.Errorf("temporary files left: %v", tempFiles(t, ws))
	}
	if _, err := os.Lstat(filepath.Join(ws, "revoked.bin")); !os.IsNotExist(err) {
		t.Errorf("the revoked upload was written: %v", err)
	}
}

// An upload over the sandbox's disk quota fails with payload_too_large and leaves the disk as it
// was: nothing written, the space given back.
func TestUploadPutOverDiskQuota(t *testing.T) {
	t.Parallel()
	tmpl := map[string]provider.Template{"default": provider.DefaultTemplate(), "small": {Name: "small", Disk: 16 << 20}}
	b := servertest.New(t, servertest.Options{Provider: "namespace", Templates: tmpl})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "door-full", Template: "small"}); err != nil {
		t.Fatal(err)
	}
	m := mintFor(t, b, "door-full", "fs:read", "fs:write")
	r, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.Upload(t.Context(), "big.bin", bytes.NewReader(make([]byte, 32<<20))); code(err) != protocol.CodeTooLarge {
		t.Fatalf("32 MiB into a 16 MiB sandbox: %v", err)
	}
	if _, err := r.Stat(t.Context(), "big.bin"); code(err) != protocol.CodeFileNotFound {
		t.Errorf("the refused upload's file: %v", err)
	}
	// The space is back: a file of most of the quota fits.
	if _, err := r.Upload(t.Context(), "fits.bin", bytes.NewReader(make([]byte, 8<<20))); err != nil {
		t.Errorf("8 MiB after the refused upload: %v", err)
	}
}

// The door counts against the dataplane's connection caps and the failed-authentication guard
// like an upgrade.
func TestUploadPutLimits(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir", AuthFailures: 2, AuthFailureWindow: time.Hour,
		Dataplane: server.DataplaneLimits{PerCredential: 1}})
	m := mintFor(t, b, "door-caps", "fs:write")
	r, err := backend.Dial(t.Context(), backend.Config{URL: m.Sandbox.DataplaneURL, Credential: m.Token})
	if err != nil {
		t.Fatal(err)
	}
	if status, code, _ := putUpload(t, b, m.Sandbox.SandboxID, "path=a.txt", m.Token, strings.NewReader("x")); status != 429 || code != protocol.CodeTooManyConnections {
		t.Errorf("an upload beside the token's one connection: %d %s", status, code)
	}
	r.Close()
	if !wait.Until(10*time.Second, func() bool {
		status, _, _ := putUpload(t, b, m.Sandbox.SandboxID, "path=a.txt", m.Token, strings.NewReader("x"))
		return status == 200
	}) {
		t.Errorf("the upload is still refused once the connection closed")
	}

	bad := m.Token[:len(m.Token)-4] + "AAAA"
	for range 2 {
		putUpload(t, b, m.Sandbox.SandboxID, "path=a.txt", bad, strings.NewReader("x"))
	}
	if status, code, _ := putUpload(t, b, m.Sandbox.SandboxID, "path=a.txt", m.Token, strings.NewReader("x")); status != 429 || code != protocol.CodeRateLimited {
		t.Errorf("after failed authentications, even a good token from that address: %d %s", status, code)
	}
}

// The 75 s rule is an idle rule, as on the WebSocket: a client on a slow link that keeps sending
// keeps its upload however long it takes, while one that goes silent loses it (here with the
// rule shortened to 2 s). It used to be a rate: each 1 MiB buffer had to fill within the 75 s,
// cutting off any link slower than 14 KB/s.
func TestUploadPutIdleBody(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	const idle = 2 * time.Second
	server.SetUploadIdle(b.Server, idle)
	m := mintFor(t, b, "door-slow", "fs:write")
	ws := workspaceDir(b, m.Sandbox.SandboxID)

	// A byte every tenth of the idle time, for over twice the idle time.
	pr, pw := io.Pipe()
	const sends = 25
	go func() {
		tick := time.NewTicker(idle / 10)
		defer tick.Stop()
		for range sends {
			<-tick.C
			if _, err := pw.Write([]byte("s")); err != nil {
				return
			}
		}
		pw.Close()
	}()
	status, code, res := putUpload(t, b, m.Sandbox.SandboxID, "path=slow.txt", m.Token, pr)
	if status != 200 || res.Size != sends {
		t.Fatalf("a slow but steady body: %d %s %+v", status, code, res)
	}

	// A body that goes silent is refused once the idle time has passed, and writes nothing.
	os.WriteFile(filepath.Join(ws, "silent.txt"), []byte("before"), 0o644)
	c, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "PUT /v1/sandboxes/"+m.Sandbox.SandboxID+"/dataplane/upload?path=silent.txt HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+m.Token+"\r\nContent-Length: 100\r\n\r\nsome")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	var eb protocol.ErrorBody
	json.NewDecoder(resp.Body).Decode(&eb)
	resp.Body.Close()
	if resp.StatusCode != 400 || eb.Error.Code != protocol.CodeInvalidArgument || !strings.Contains(eb.Error.Message, "sent nothing") {
		t.Errorf("a silent body: %d %+v", resp.StatusCode, eb.Error)
	}
	if got, _ := os.ReadFile(filepath.Join(ws, "silent.txt")); string(got) != "before" {
		t.Errorf("a silent body replaced the file: %q", got)
	}
	if left := tempFiles(t, ws); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

// A refused upload is answered at once, whatever its body does: net/http would otherwise read up
// to 256 KiB more of an unread body before it writes the answer, so a client streaming slowly (or
// a hostile one sending nothing more) got no answer at all, and held the connection meanwhile.
func TestUploadPutRefusalAnswersAtOnce(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	reader := mintFor(t, b, "door-refused", "fs:read")
	writer := mintFor(t, b, "door-refused", "fs:write")
	id := reader.Sandbox.SandboxID
	cases := []struct {
		name, query, cred, code string
	}{
		{"the scope (the handler)", "path=a.txt", reader.Token, protocol.CodeScopeDenied},
		{"a path out", "path=../a.txt", writer.Token, protocol.CodeInvalidPath},
		{"an unknown parameter (the query check)", "path=a.txt&x=1", writer.Token, protocol.CodeInvalidArgument},
		{"no credential", "path=a.txt", "", protocol.CodeUnauthenticated},
	}
	for _, c := range cases {
		conn, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		auth := ""
		if c.cred != "" {
			auth = "Authorization: Bearer " + c.cred + "\r\n"
		}
		// The first chunk of a body whose next ones never come.
		io.WriteString(conn, "PUT /v1/sandboxes/"+id+"/dataplane/upload?"+c.query+" HTTP/1.1\r\nHost: x\r\n"+auth+"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
		conn.SetReadDeadline(time.Now().Add(20 * time.Second)) // a bound for the failure, not a wait
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Errorf("%s: no answer: %v", c.name, err)
			conn.Close()
			continue
		}
		var eb protocol.ErrorBody
		json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		conn.Close()
		if eb.Error.Code != c.code || !resp.Close {
			t.Errorf("%s: %d %s (closing: %v), want %s and the connection closed", c.name, resp.StatusCode, eb.Error.Code, resp.Close, c.code)
		}
	}
}

// An owner's upload ended by its key's revocation answers unauthenticated, but the request had
// authenticated: it is not a guessed credential, and must not count toward its address's
// failed-authentication limit (a host running many uploads with a key that gets rotated would
// otherwise lock out every other client behind its address). The access log names the key.
func TestUploadPutKeyRevokedMidUploadIsNoGuess(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir", AuthFailures: 1, AuthFailureWindow: time.Hour})
	m := mintFor(t, b, "door-key", "fs:write")
	id := m.Sandbox.SandboxID
	ws := workspaceDir(b, id)
	key, k, err := b.Store.CreateAPIKey(t.Context(), b.Org, "ci", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	io.WriteString(conn, "PUT /v1/sandboxes/"+id+"/dataplane/upload?path=k.txt HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "+key+"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
	if !wait.Until(10*time.Second, func() bool { return len(tempFiles(t, ws)) == 1 }) {
		t.Fatal("the upload never started")
	}
	if _, err := b.Store.RevokeAPIKey(t.Context(), k.ID, time.Now()); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Errorf("the upload of a revoked key: %d", resp.StatusCode)
	}
	for range 2 { // the limit allows one failure: a second would show
		if status, code, _ := putUpload(t, b, id, "path=after.txt", m.Token, strings.NewReader("x")); status != 200 {
			t.Fatalf("a good token from the same address after the revocation: %d %s", status, code)
		}
	}
}

// The access log line of an upload names who sent it, as the WebSocket's connection log does: the
// token by its jti (a refused upload leaves no event), never the token itself.
func TestUploadPutAccessLogNamesTheToken(t *testing.T) {
	t.Parallel()
	var logs wait.Buffer
	b := servertest.New(t, servertest.Options{Provider: "dir", Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	reader := mintFor(t, b, "door-log", "fs:read")
	if status, code, _ := putUpload(t, b, reader.Sandbox.SandboxID, "path=a.txt", reader.Token, strings.NewReader("x")); status != 403 {
		t.Fatalf("a token without fs:write: %d %s", status, code)
	}
	var line string
	for l := range strings.SplitSeq(logs.String(), "\n") {
		if strings.Contains(l, "dataplane/upload") && strings.Contains(l, "status=403") {
			line = l
		}
	}
	if !strings.Contains(line, "jti="+reader.JTI) {
		t.Errorf("the refused upload's access log line does not name the token's jti: %q", line)
	}
	if strings.Contains(logs.String(), reader.Token) {
		t.Errorf("the log holds the token")
	}
}

// TestUploadHonoursDialTimeout: an upload opens its own connection beside the WebSocket; when the
// broker's address stops taking connections (its accept queue full: the SYNs are dropped and the
// connect would retry for two minutes), the upload fails as unreachable within the backend's
// DialTimeout, as a dial of the dataplane does, and not after a fixed 10 s of its own.
func TestUploadHonoursDialTimeout(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{Provider: "dir"})
	m := mintFor(t, b, "door-dial", "fs:write")
	// A listener with an accept queue of one, in front of the broker: it passes on the WebSocket's
	// connection, then takes no other.
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	lf := os.NewFile(uintptr(fd), "listener")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		up, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
		if err != nil {
			return
		}
		defer up.Close()
		go io.Copy(up, c)
		io.Copy(c, up)
	}()
	u, _ := url.Parse(m.Sandbox.DataplaneURL)
	u.Host = ln.Addr().String()
	r, err := backend.Dial(t.Context(), backend.Config{URL: u.String(), Credential: m.Token, DialTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	// Fill the accept queue: connections past it wait for a SYN-ACK that never comes.
	for range 3 {
		if c, err := net.DialTimeout("tcp", ln.Addr().String(), 200*time.Millisecond); err == nil {
			defer c.Close()
		}
	}
	done := make(chan error, 1)
	go func() {
		_, err := r.Upload(t.Context(), "f.txt", strings.NewReader("content"))
		done <- err
	}()
	select {
	case err := <-done:
		var pe *protocol.Error
		if !errors.As(err, &pe) || pe.Code != protocol.CodeUnreachable {
			t.Fatalf("an upload to an address taking no connections: %v", err)
		}
	case <-time.After(8 * time.Second):
		t.Fatal("the upload's connect outlived the backend's DialTimeout (200 ms) by 8 s")
	}
}
