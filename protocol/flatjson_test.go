package protocol_test

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// targets are the types DecodeFlat handles, each freshly allocated per input.
var flatTargets = []func() any{
	func() any { return &protocol.WriteArgs{} }, func() any { return &protocol.ReadArgs{} },
	func() any { return &protocol.EditArgs{} }, func() any { return &protocol.StatArgs{} },
	func() any { return &protocol.LsArgs{} }, func() any { return &protocol.ReadResult{} },
	func() any { return &protocol.WriteHead{} }, func() any { return &protocol.ReadHead{} },
	func() any { return &protocol.WriteResult{} }, func() any { return &protocol.EditResult{} },
	func() any { return &protocol.ExecArgs{} }, func() any { return &protocol.ExecResult{} },
}

// Whenever DecodeFlat accepts an input, encoding/json (strict: known fields, one value) accepts it
// too and decodes exactly the same value.
func FuzzDecodeFlat(f *testing.F) {
	for _, s := range []string{
		`{"path":"a.txt","content":"hi\n\"x\"\\\/\t"}`, `{"path":"a","line_offset":10,"line_limit":-3}`,
		`{"path":"p","old":"a","new":"b","replace_all":true}`, `{ "path" : "x" }`, `{}`, `{"path":"é€😀"}`,
		`{"path":"a","path":"b"}`, `{"PATH":"a"}`, `{"path":"\u0041"}`, `{"size":12345678901234567}`,
		`{"size":1e3}`, `{"size":012}`, `{"created":true,"size":5}`, `{"path":"a",}`, `{"path":"a"} x`,
		`{"path":"a\x01"}`, `{"truncated":false,"encoding":"base64"}`, `{"occurrences":-0}`,
		`{"argv":["true"]}`, `{"argv":[]}`, `{"argv":[ "a" , "b\n" ],"cwd":"/w","timeout_ms":5}`,
		`{"argv":["a"],"argv":["b","c"]}`, `{"argv":null}`, `{"argv":["a",]}`, `{"argv":[1]}`,
		`{"command":"ls","env":{"A":"b"}}`, `{"command":"x","stream":true,"combined":false,"max_output":9}`,
		`{"exit_code":0,"duration_ms":1,"stdout":"","stderr":"e"}`, `{"exit_code":137,"signal":"KILL","output":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, mk := range flatTargets {
			fast := mk()
			if !protocol.DecodeFlat(b, fast) {
				continue
			}
			slow := mk()
			dec := json.NewDecoder(bytes.NewReader(b))
			dec.DisallowUnknownFields()
			if err := dec.Decode(slow); err != nil || len(bytes.TrimSpace(b[dec.InputOffset():])) != 0 {
				t.Fatalf("DecodeFlat accepted %q into %T, encoding/json refuses: %v", b, fast, err)
			}
			if !reflect.DeepEqual(fast, slow) {
				t.Fatalf("%q into %T: DecodeFlat %+v, encoding/json %+v", b, fast, fast, slow)
			}
		}
	})
}

func TestDecodeFlatTakesTheHotPath(t *testing.T) {
	var w protocol.WriteArgs
	body := strings.Repeat("line with \"quotes\" and \t tabs\n", 100)
	raw, _ := json.Marshal(protocol.WriteArgs{Path: "/workspace/a.go", Content: body, Mode: "create"})
	if !protocol.DecodeFlat(raw, &w) || w.Content != body || w.Mode != "create" {
		t.Fatalf("a canonical write did not take the fast path: %+v", w)
	}
	var r protocol.ReadResult
	raw, _ = json.Marshal(protocol.ReadResult{Path: "/workspace/a.go", Content: body, Encoding: "utf-8", Size: 99, TotalLines: 100})
	if !protocol.DecodeFlat(raw, &r) || r.Content != body || r.TotalLines != 100 {
		t.Fatalf("a read result did not take the fast path: %+v", r)
	}
	var e protocol.ExecArgs
	raw, _ = json.Marshal(protocol.ExecArgs{Argv: []string{"go", "test", "./..."}, Cwd: "/workspace/x", TimeoutMS: 60000})
	if !protocol.DecodeFlat(raw, &e) || len(e.Argv) != 3 || e.Argv[2] != "./..." || e.TimeoutMS != 60000 {
		t.Fatalf("an exec's args did not take the fast path: %+v", e)
	}
	if protocol.DecodeFlat([]byte(`{"command":"ls","env":{"A":"b"}}`), &protocol.ExecArgs{}) {
		t.Fatal("an environment is a map: encoding/json decodes it")
	}
	var x protocol.ExecResult
	out := "hi\n"
	raw, _ = json.Marshal(protocol.ExecResult{ExitCode: 2, DurationMS: 3, Stdout: &out, Stderr: new(string)})
	if !protocol.DecodeFlat(raw, &x) || x.ExitCode != 2 || *x.Stdout != out || x.Stderr == nil || *x.Stderr != "" {
		t.Fatalf("an exec result did not take the fast path: %+v", x)
	}
}

func BenchmarkDecodeFlatWrite4KiB(b *testing.B) {
	raw, _ := json.Marshal(protocol.WriteArgs{Path: "bench.txt", Content: strings.Repeat("x", 4096)})
	for i := 0; i < b.N; i++ {
		var w protocol.WriteArgs
		protocol.DecodeFlat(raw, &w)
	}
}
