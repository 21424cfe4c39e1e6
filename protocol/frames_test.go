package protocol_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"os"
	"reflect"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

type golden struct {
	Name       string          `json:"name"`
	From       string          `json:"from"`
	Op         string          `json:"op"`
	Result     string          `json:"result"`
	Text       json.RawMessage `json:"text"`
	Binary     string          `json:"binary"`
	Kind       byte            `json:"kind"`
	ID         uint32          `json:"id"`
	PayloadHex string          `json:"payload_hex"`
	JSON       json.RawMessage `json:"json"`
	BodyHex    string          `json:"body_hex"`
}

// argTypes and resultTypes are the Go types each golden frame's args or result decode into.
var argTypes = map[string]func() any{
	"stat": func() any { return &protocol.StatArgs{} }, "ls": func() any { return &protocol.LsArgs{} },
	"read": func() any { return &protocol.ReadArgs{} }, "write": func() any { return &protocol.WriteHead{} },
	"edit": func() any { return &protocol.EditArgs{} }, "delete": func() any { return &protocol.DeleteArgs{} },
	"mkdir": func() any { return &protocol.MkdirArgs{} }, "move": func() any { return &protocol.MoveArgs{} },
	"glob": func() any { return &protocol.GlobArgs{} }, "grep": func() any { return &protocol.GrepArgs{} },
	"exec": func() any { return &protocol.ExecArgs{} }, "upload": func() any { return &protocol.UploadArgs{} },
	"download": func() any { return &protocol.DownloadArgs{} },
	"untar":    func() any { return &protocol.UntarArgs{} }, "tar": func() any { return &protocol.TarArgs{} },
	"changes": func() any { return &protocol.ChangesArgs{} }, "shell": func() any { return &protocol.ShellArgs{} },
	"resize": func() any { return &protocol.ResizeArgs{} },
}

// argless are the ops that take no args.
var argless = map[string]bool{protocol.OpPing: true, protocol.OpCancel: true, protocol.OpEnv: true}

// allOps is every operation of the protocol: each has at least one golden client frame.
var allOps = []string{
	protocol.OpPing, protocol.OpCancel, protocol.OpEnv, protocol.OpStat, protocol.OpLs, protocol.OpRead,
	protocol.OpWrite, protocol.OpEdit, protocol.OpDelete, protocol.OpMkdir, protocol.OpMove, protocol.OpGlob,
	protocol.OpGrep, protocol.OpUpload, protocol.OpDownload, protocol.OpUntar, protocol.OpTar,
	protocol.OpChanges, protocol.OpExec, protocol.OpShell, protocol.OpResize,
}

var resultTypes = map[string]func() any{
	"stat": func() any { return &protocol.FileInfo{} }, "ls": func() any { return &protocol.LsResult{} },
	"read": func() any { return &protocol.ReadHead{} }, "write": func() any { return &protocol.WriteResult{} },
	"edit": func() any { return &protocol.EditResult{} }, "path": func() any { return &protocol.PathResult{} },
	"glob": func() any { return &protocol.GlobResult{} }, "grep": func() any { return &protocol.GrepResult{} },
	"env": func() any { return &protocol.EnvResult{} }, "exec": func() any { return &protocol.ExecResult{} },
	"download": func() any { return &protocol.DownloadResult{} },
	"tree":     func() any { return &protocol.TreeResult{} },
	"changes":  func() any { return &protocol.ChangesResult{} },
}

// strict decodes raw into v refusing unknown fields, then encodes v back: the golden frame must
// survive the trip unchanged.
func roundTrip(t *testing.T, name string, raw json.RawMessage, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: does not decode into %T: %v", name, v, err)
	}
	back, _ := json.Marshal(v)
	var want, got any
	json.Unmarshal(raw, &want)
	json.Unmarshal(back, &got)
	if !reflect.DeepEqual(want, got) {
		t.Fatalf("%s: re-encodes differently\nwant %s\ngot  %s", name, raw, back)
	}
}

func TestGoldenFrames(t *testing.T) {
	raw, err := os.ReadFile("testdata/frames.json")
	if err != nil {
		t.Fatal(err)
	}
	var file struct{ Frames []golden }
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	seen, ops := map[string]bool{}, map[string]bool{}
	for _, f := range file.Frames {
		if seen[f.Name] {
			t.Errorf("two frames are named %q", f.Name)
		}
		seen[f.Name] = true
		if f.Result != "" && resultTypes[f.Result] == nil {
			t.Errorf("%s: result kind %q has no Go type here", f.Name, f.Result)
		}
		switch {
		case f.Kind == protocol.FrameRequestBody || f.Kind == protocol.FrameAnswerBody:
			b, _ := hex.DecodeString(f.Binary)
			kind, id, payload, err := protocol.ParseFrame(b)
			if err != nil || kind != f.Kind || id != f.ID {
				t.Fatalf("%s: parsed %d %d %v", f.Name, kind, id, err)
			}
			js, body, err := protocol.SplitBody(payload)
			want, _ := hex.DecodeString(f.BodyHex)
			if err != nil || !bytes.Equal(body, want) {
				t.Fatalf("%s: body %x, %v", f.Name, body, err)
			}
			var compact bytes.Buffer
			json.Compact(&compact, f.JSON)
			if !bytes.Equal(js, compact.Bytes()) {
				t.Errorf("%s: JSON %s, want %s", f.Name, js, compact.Bytes())
			}
			if again := protocol.AppendBodyFrame(nil, kind, id, js, body); !bytes.Equal(again, b) {
				t.Errorf("%s: does not re-encode", f.Name)
			}
			if kind == protocol.FrameRequestBody {
				var env struct {
					ID   uint32          `json:"id"`
					Op   string          `json:"op"`
					Args json.RawMessage `json:"args"`
				}
				roundTrip(t, f.Name, js, &env)
				if env.ID != id || argTypes[env.Op] == nil {
					t.Fatalf("%s: id %d op %q", f.Name, env.ID, env.Op)
				}
				ops[env.Op] = true
				roundTrip(t, f.Name+" args", env.Args, argTypes[env.Op]())
			} else {
				var env struct {
					ID     uint32          `json:"id"`
					Result json.RawMessage `json:"result"`
				}
				roundTrip(t, f.Name, js, &env)
				if env.ID != id {
					t.Fatalf("%s: id %d", f.Name, env.ID)
				}
				roundTrip(t, f.Name+" result", env.Result, resultTypes[f.Result]())
			}
		case f.Binary != "":
			b, _ := hex.DecodeString(f.Binary)
			kind, id, payload, err := protocol.ParseFrame(b)
			want, _ := hex.DecodeString(f.PayloadHex)
			if err != nil || kind != f.Kind || id != f.ID || !bytes.Equal(payload, want) {
				t.Errorf("%s: parsed %d %d %x %v", f.Name, kind, id, payload, err)
			}
			again := make([]byte, protocol.FrameHeaderLen)
			protocol.PutFrameHeader(again, kind, id)
			if !bytes.Equal(append(again, payload...), b) {
				t.Errorf("%s: header does not re-encode", f.Name)
			}
		case f.From == "client":
			var env struct {
				ID   uint32          `json:"id"`
				Op   string          `json:"op"`
				Args json.RawMessage `json:"args,omitempty"`
			}
			roundTrip(t, f.Name, f.Text, &env)
			if f.Op != "" && f.Op != env.Op {
				t.Errorf("%s: op %q, labelled %q", f.Name, env.Op, f.Op)
			}
			ops[env.Op] = true
			if mk := argTypes[env.Op]; mk != nil {
				roundTrip(t, f.Name+" args", env.Args, mk())
			} else if !argless[env.Op] {
				t.Errorf("%s: op %q has no argument type here", f.Name, env.Op)
			} else if len(env.Args) > 0 {
				t.Errorf("%s: args for %q, which takes none", f.Name, env.Op)
			}
		default:
			var env struct {
				ID     uint32          `json:"id"`
				Type   string          `json:"type,omitempty"`
				Hello  *protocol.Hello `json:"hello,omitempty"`
				Result json.RawMessage `json:"result,omitempty"`
				Error  *protocol.Error `json:"error,omitempty"`
			}
			roundTrip(t, f.Name, f.Text, &env)
			if mk := resultTypes[f.Result]; mk != nil {
				roundTrip(t, f.Name+" result", env.Result, mk())
			}
		}
	}
	for _, op := range allOps {
		if !ops[op] {
			t.Errorf("no golden client frame for op %q", op)
		}
	}
}
