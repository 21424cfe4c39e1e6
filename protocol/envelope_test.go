package protocol_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// Whenever SplitRequest recognizes a frame, encoding/json reads the same id, op and args from it.
func FuzzSplitRequest(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"op":"ping"}`, `{"id":7,"op":"read","args":{"path":"a"}}`, `{"id":4294967295,"op":"x","args":null}`,
		`{"id":4294967296,"op":"x"}`, `{"id":01,"op":"x"}`, `{"id":1.5,"op":"x"}`, `{"id":1,"op":"x","args":{}},"op":"y"}`,
		`{"id":1,"op":"x","args":{"a":"}"}}`, `{"id":1,"op":"x\"y"}`, `{"id":1,"op":"x","args":1}`, `{"id":-1,"op":"x"}`,
		`{"id":1,"op":"x","args":{"a":1}, "id":2}`, `{"id":1,"op":"ping","op":"exec"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		id, op, args, ok := protocol.SplitRequest(b)
		// The caller decodes args strictly: one JSON value, nothing after it. Args that are not
		// one JSON value are refused there, so only the others must agree with encoding/json.
		if !ok || (args != nil && !json.Valid(args)) {
			return
		}
		var full struct {
			ID   uint32          `json:"id"`
			Op   string          `json:"op"`
			Args json.RawMessage `json:"args"`
		}
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&full); err != nil || dec.More() {
			t.Fatalf("split %q, but encoding/json refuses the frame: %v", b, err)
		}
		if full.ID != id || full.Op != op || (args != nil && !bytes.Equal(bytes.TrimSpace(full.Args), bytes.TrimSpace(args))) {
			t.Fatalf("%q: split %d %q %q, encoding/json %d %q %q", b, id, op, args, full.ID, full.Op, full.Args)
		}
	})
}

func TestSplitResult(t *testing.T) {
	id, res, ok := protocol.SplitResult([]byte(`{"id":12,"result":{"path":"/workspace/a"}}`))
	if !ok || id != 12 || string(res) != `{"path":"/workspace/a"}` {
		t.Fatalf("%d %q %v", id, res, ok)
	}
	for _, s := range []string{`{"id":1,"error":{"code":"x"}}`, `{"result":{},"id":1}`, `{"id":1,"result":{}} `, `{"id":99999999999,"result":{}}`} {
		if _, _, ok := protocol.SplitResult([]byte(s)); ok {
			t.Errorf("%q recognized", s)
		}
	}
}
