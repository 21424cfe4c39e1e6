package backend_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

func TestMain(m *testing.M) { servertest.Main(m) }

// entry is one step of the transcript: what was asked, and the normalized answer or error code.
type entry struct {
	Step   string
	Result any    `json:",omitempty"`
	Error  string `json:",omitempty"`
}

// normalize drops what legitimately differs between hosts: times, durations, directory sizes.
func normalize(v any) any {
	b, _ := json.Marshal(v)
	var m any
	json.Unmarshal(b, &m)
	var walk func(any) any
	walk = func(x any) any {
		switch t := x.(type) {
		case map[string]any:
			delete(t, "mod_time")
			delete(t, "duration_ms")
			if t["type"] == "dir" {
				delete(t, "size")
			}
			for k, v := range t {
				t[k] = walk(v)
			}
		case []any:
			for i, v := range t {
				t[i] = walk(v)
			}
		}
		return x
	}
	return walk(m)
}

// suite runs every operation, happy paths and errors, and records the answers.
func suite(t *testing.T, b backend.Backend) []entry {
	ctx := t.Context()
	var log []entry
	rec := func(step string, res any, err error) {
		e := entry{Step: step}
		var pe *protocol.Error
		switch {
		case errors.As(err, &pe):
			e.Error = pe.Code
		case err != nil:
			e.Error = "non-protocol error: " + err.Error()
		default:
			e.Result = normalize(res)
		}
		log = append(log, e)
	}
	do := func(step string, fn func() (any, error)) { res, err := fn(); rec(step, res, err) }
	ex := func(step string, a protocol.ExecArgs) {
		res, err := b.Exec(ctx, backend.ExecRequest{ExecArgs: a})
		rec(step, res, err)
	}

	do("write", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "/workspace/a.txt", Content: "one\ntwo\nthree\ntwo\n"})
	})
	do("write relative into new dir", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "src/pkg/main.go", Content: "package main\n// TODO: more\nfunc main() {}\n"})
	})
	do("write base64", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "bin.dat", Content: "AAECA/8=", Encoding: "base64"})
	})
	do("write create existing", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "a.txt", Content: "x", Mode: "create"})
	})
	do("write bad encoding", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "x", Content: "x", Encoding: "rot13"})
	})
	do("read", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "a.txt"}) })
	do("read lines", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "a.txt", LineOffset: 1, LineLimit: 2}) })
	do("read bytes", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "a.txt", Offset: 4, Length: 3}) })
	do("read binary", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "bin.dat"}) })
	do("read both windows", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "a.txt", Offset: 1, LineLimit: 1}) })
	do("read missing", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "nope.txt"}) })
	do("read dir", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "src"}) })
	do("stat file", func() (any, error) { return b.Stat(ctx, "a.txt") })
	do("stat dir", func() (any, error) { return b.Stat(ctx, "/workspace/src") })
	do("stat missing", func() (any, error) { return b.Stat(ctx, "nope") })
	do("ls", func() (any, error) { return b.Ls(ctx, "/workspace/src/pkg") })
	do("ls file", func() (any, error) { return b.Ls(ctx, "a.txt") })
	do("edit unique", func() (any, error) { return b.Edit(ctx, protocol.EditArgs{Path: "a.txt", Old: "three", New: "3"}) })
	do("edit not unique", func() (any, error) { return b.Edit(ctx, protocol.EditArgs{Path: "a.txt", Old: "two", New: "2"}) })
	do("edit replace all", func() (any, error) {
		return b.Edit(ctx, protocol.EditArgs{Path: "a.txt", Old: "two", New: "2", ReplaceAll: true})
	})
	do("edit no match", func() (any, error) { return b.Edit(ctx, protocol.EditArgs{Path: "a.txt", Old: "zzz", New: "y"}) })
	do("edit empty old", func() (any, error) { return b.Edit(ctx, protocol.EditArgs{Path: "a.txt", Old: "", New: "y"}) })
	do("read after edits", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "a.txt"}) })
	do("mkdir", func() (any, error) { return nil, b.Mkdir(ctx, protocol.MkdirArgs{Path: "d1"}) })
	do("mkdir existing", func() (any, error) { return nil, b.Mkdir(ctx, protocol.MkdirArgs{Path: "d1"}) })
	do("mkdir parents", func() (any, error) { return nil, b.Mkdir(ctx, protocol.MkdirArgs{Path: "d2/x/y", Parents: true}) })
	do("mkdir missing parent", func() (any, error) { return nil, b.Mkdir(ctx, protocol.MkdirArgs{Path: "d3/x"}) })
	do("move", func() (any, error) { return nil, b.Move(ctx, protocol.MoveArgs{From: "bin.dat", To: "d1/bin.dat"}) })
	do("move onto existing", func() (any, error) {
		return nil, b.Move(ctx, protocol.MoveArgs{From: "d1/bin.dat", To: "a.txt"})
	})
	do("glob", func() (any, error) { return b.Glob(ctx, protocol.GlobArgs{Pattern: "**/*.go"}) })
	do("glob bad", func() (any, error) { return b.Glob(ctx, protocol.GlobArgs{Pattern: "[a"}) })
	do("grep literal", func() (any, error) { return b.Grep(ctx, protocol.GrepArgs{Pattern: "TODO"}) })
	do("grep regex", func() (any, error) {
		return b.Grep(ctx, protocol.GrepArgs{Pattern: "^fun.*\\(\\)", Regex: true, Glob: "*.go"})
	})
	do("grep max count", func() (any, error) { return b.Grep(ctx, protocol.GrepArgs{Pattern: "2", MaxCount: 1}) })
	do("grep bad regex", func() (any, error) { return b.Grep(ctx, protocol.GrepArgs{Pattern: "(", Regex: true}) })
	do("delete non-empty dir", func() (any, error) { return nil, b.Delete(ctx, protocol.DeleteArgs{Path: "d2"}) })
	do("delete recursive", func() (any, error) { return nil, b.Delete(ctx, protocol.DeleteArgs{Path: "d2", Recursive: true}) })
	do("delete missing", func() (any, error) { return nil, b.Delete(ctx, protocol.DeleteArgs{Path: "d2"}) })
	do("delete root", func() (any, error) {
		return nil, b.Delete(ctx, protocol.DeleteArgs{Path: "/workspace", Recursive: true})
	})
	for _, p := range []string{"../etc/passwd", "/etc/passwd", "/workspace/../etc/passwd", "a\x00b", "\xff\xfe"} {
		do("read escape "+fmt.Sprintf("%q", p), func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: p}) })
		do("write escape "+fmt.Sprintf("%q", p), func() (any, error) { return b.Write(ctx, protocol.WriteArgs{Path: p, Content: "x"}) })
	}
	// A symlink planted from inside that points out of the workspace.
	ex("plant symlink", protocol.ExecArgs{Command: "ln -s /etc etc && ln -s ../../.. up && echo planted", Combined: true})
	do("read through planted symlink", func() (any, error) { return b.Read(ctx, protocol.ReadArgs{Path: "/workspace/etc/passwd"}) })
	do("write through planted symlink", func() (any, error) {
		return b.Write(ctx, protocol.WriteArgs{Path: "/workspace/up/tmp/pwned", Content: "x"})
	})
	do("grep does not follow it", func() (any, error) { return b.Grep(ctx, protocol.GrepArgs{Pattern: "root:"}) })

	big := bytes.Repeat([]byte("conformance!"), 250000) // 3 MB
	do("upload", func() (any, error) { return b.Upload(ctx, "big.bin", bytes.NewReader(big)) })
	do("download", func() (any, error) {
		var got bytes.Buffer
		n, err := b.Download(ctx, "big.bin", &got)
		return map[string]any{"n": n, "same": bytes.Equal(got.Bytes(), big)}, err
	})
	do("download missing", func() (any, error) { return b.Download(ctx, "nope", &bytes.Buffer{}) })

	ex("exec combined", protocol.ExecArgs{Command: "echo out; echo err >&2; exit 7", Combined: true})
	ex("exec separate", protocol.ExecArgs{Command: "echo out; echo err >&2"})
	ex("exec argv", protocol.ExecArgs{Argv: []string{"printf", "%s-%s", "a b", "c"}, Combined: true})
	ex("exec stdin", protocol.ExecArgs{Command: "tr a-z A-Z", Stdin: "shout", Combined: true})
	ex("exec env", protocol.ExecArgs{Command: "echo $GREETING", Env: map[string]string{"GREETING": "hi"}, Combined: true})
	ex("exec cwd", protocol.ExecArgs{Command: "ls", Cwd: "/workspace/src", Combined: true})
	ex("exec cwd missing", protocol.ExecArgs{Command: "true", Cwd: "/workspace/nope"})
	ex("exec cwd escape", protocol.ExecArgs{Command: "true", Cwd: "/etc"})
	ex("exec cwd is a file", protocol.ExecArgs{Command: "true", Cwd: "/workspace/a.txt"})
	ex("exec sees file ops", protocol.ExecArgs{Command: "cat a.txt", Combined: true})
	ex("exec signal", protocol.ExecArgs{Command: "kill -TERM $$", Combined: true})
	ex("exec not found", protocol.ExecArgs{Command: "no-such-program-here", Combined: true})
	ex("exec timeout", protocol.ExecArgs{Command: "sleep 10", TimeoutMS: 300, Combined: true})
	ex("exec truncated", protocol.ExecArgs{Command: "yes | head -c 100000", MaxOutput: 10, Combined: true})
	ex("exec truncated on stderr", protocol.ExecArgs{Command: "head -c 5000 /dev/zero | tr '\\0' e >&2", MaxOutput: 10})
	ex("exec invalid utf-8", protocol.ExecArgs{Command: `printf 'a\377b\n'; printf 'c\376d' >&2`})
	// The broker holds a non-streamed answer in memory: past 8 MiB it must be streamed, locally too.
	ex("exec max_output over the answer limit", protocol.ExecArgs{Command: "true", MaxOutput: protocol.ExecMaxAnswerOutput + 1})
	ex("exec max_output over the stream limit", protocol.ExecArgs{Command: "true", MaxOutput: protocol.ExecMaxStreamOutput + 1, Stream: true})
	ex("exec neither", protocol.ExecArgs{})
	ex("exec both", protocol.ExecArgs{Command: "true", Argv: []string{"true"}})
	start := time.Now()
	ex("exec leaves background", protocol.ExecArgs{Command: "sleep 30 & echo started", Combined: true})
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("a background child held the answer for %s", d)
	}
	var sout, serr bytes.Buffer
	res, err := b.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo a; echo b >&2"}, Stdout: &sout, Stderr: &serr})
	rec("exec streamed", map[string]any{"result": res, "stdout": sout.String(), "stderr": serr.String()}, err)
	sout.Reset()
	res, err = b.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo big", MaxOutput: protocol.ExecMaxAnswerOutput + 1}, Stdout: &sout})
	rec("exec streamed past the answer limit", map[string]any{"result": res, "stdout": sout.String()}, err)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = b.Exec(cctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "sleep 10"}})
	cancel()
	rec("exec cancelled by the caller", nil, normalizeCancel(err))
	return log
}

// normalizeCancel: a cancelled call returns the caller's context error locally, and either that or
// the broker's "cancelled" remotely; both mean the same to a tool.
func normalizeCancel(err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return protocol.Errorf(protocol.CodeCancelled, "cancelled")
	}
	return err
}

func TestConformance(t *testing.T) {
	if _, err := os.Stat("/usr/bin/bwrap"); err != nil {
		t.Fatal("bubblewrap is not installed: run scripts/deps.sh (apt-get install -y bubblewrap)")
	}
	local, err := backend.Local(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	want := suite(t, local)

	b := servertest.New(t, servertest.Options{Provider: "namespace"})
	b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "conf"})
	m, err := b.Client.Delegate(t.Context(), "conf", protocol.MintRequest{Scopes: protocol.Scopes})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := backend.FromRunConfig(t.Context(), map[string]any{"sandbox": m.Sandbox}, backend.RunConfigOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer remote.Close()
	got := suite(t, remote)
	// A request over the broker's frame limit is refused before it is sent: sent, it would break
	// the connection under every call sharing it.
	_, err = remote.Exec(t.Context(), backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "wc -c", Stdin: strings.Repeat("x", 2<<20)}})
	if !errors.Is(err, &protocol.Error{Code: protocol.CodeTooLarge}) || backend.KindOf(err) != backend.KindInvalid {
		t.Errorf("exec with 2 MiB of stdin: %v", err)
	}
	if _, err := remote.Stat(t.Context(), "a.txt"); err != nil {
		t.Errorf("the connection did not survive a refused request: %v", err)
	}

	for i := range want {
		w, _ := json.Marshal(want[i])
		g, _ := json.Marshal(got[i])
		if !bytes.Equal(w, g) {
			t.Errorf("local and remote differ\nlocal:  %s\nremote: %s", w, g)
		}
	}
	// And the transcript itself is what the protocol promises, not just the same twice.
	byStep := map[string]entry{}
	for _, e := range want {
		byStep[e.Step] = e
	}
	for step, code := range map[string]string{
		"write create existing": "file_exists", "read missing": "file_not_found", "read dir": "is_directory",
		"edit not unique": "not_unique", "edit no match": "no_match", "mkdir existing": "file_exists",
		"move onto existing": "file_exists", "delete non-empty dir": "invalid_argument", "delete root": "invalid_path",
		"read through planted symlink": "invalid_path", "write through planted symlink": "invalid_path",
		"read escape \"../etc/passwd\"": "invalid_path", "grep bad regex": "invalid_argument", "exec neither": "invalid_argument",
		"exec cwd escape": "invalid_path", "exec cancelled by the caller": "cancelled",
		"exec max_output over the answer limit": "invalid_argument", "exec max_output over the stream limit": "invalid_argument",
	} {
		if byStep[step].Error != code {
			t.Errorf("%s: want %s, got %+v", step, code, byStep[step])
		}
	}
	if e := byStep["exec streamed past the answer limit"]; e.Error != "" {
		t.Errorf("a streamed exec may ask for more than the answer limit: %+v", e)
	}
	timeout, _ := json.Marshal(byStep["exec timeout"].Result)
	if !strings.Contains(string(timeout), `"reason":"timeout"`) {
		t.Errorf("exec timeout: %s", timeout)
	}
	if s, _ := json.Marshal(byStep["grep does not follow it"]); strings.Contains(string(s), "root:") {
		t.Errorf("grep read a file outside the workspace: %s", s)
	}
}

func TestFromRunConfig(t *testing.T) {
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		cfg  any
		want string
	}{
		{"not an object", `[1]`, "configurable must be a JSON object"},
		{"sandbox not an object", map[string]any{"sandbox": "x"}, "must be an object"},
		{"missing credential", map[string]any{"sandbox": map[string]any{"sandbox_id": "sb_x", "dataplane_url": "ws://h"}}, "credential is missing"},
		{"empty url", map[string]any{"sandbox": map[string]any{"sandbox_id": "sb_x", "credential": "t", "dataplane_url": ""}}, "dataplane_url must be a non-empty string"},
		{"wrong type", map[string]any{"sandbox": map[string]any{"sandbox_id": 5, "credential": "t", "dataplane_url": "ws://h"}}, "sandbox_id must be a non-empty string"},
		{"http url", map[string]any{"sandbox": map[string]any{"sandbox_id": "sb_x", "credential": "t", "dataplane_url": "http://h"}}, "ws:// or wss://"},
		{"no block, no local", map[string]any{"thread_id": "t"}, "no sandbox block"},
	} {
		cfg := tc.cfg
		if s, ok := cfg.(string); ok {
			cfg = []byte(s)
		}
		_, err := backend.FromRunConfig(ctx, cfg, backend.RunConfigOptions{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || backend.KindOf(err) != backend.KindInvalid {
			t.Errorf("%s: %v (kind %d)", tc.name, err, backend.KindOf(err))
		}
	}
	dir := t.TempDir()
	b, err := backend.FromRunConfig(ctx, map[string]any{"other": 1}, backend.RunConfigOptions{LocalRoot: dir})
	if err != nil || b.ID() != "local:"+dir {
		t.Fatalf("local fallback: %v", err)
	}
	b.Close()
	// Extra keys in the block are ignored; an unreachable dataplane is KindUnreachable.
	_, err = backend.FromRunConfig(ctx, map[string]any{"sandbox": map[string]any{"sandbox_id": "sb_x", "credential": "t",
		"dataplane_url": "ws://127.0.0.1:1/v1/sandboxes/sb_x/dataplane", "extra": true}}, backend.RunConfigOptions{Dial: backend.Config{Reconnects: 1}})
	if backend.KindOf(err) != backend.KindUnreachable || !strings.Contains(backend.Sentence(err), "try again") {
		t.Fatalf("unreachable: %v / %s", err, backend.Sentence(err))
	}
}
