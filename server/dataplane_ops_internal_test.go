package server

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// The op table and the normative spec say the same thing: each scope's paragraph in
// docs/dataplane.md, and the Scope schema's description in docs/openapi.yaml (what a minting
// client reads), list exactly the ops the table gives that scope, and ping needs none. (Over the
// wire, TestDataplaneScopes runs every op under every scope.)
func TestOpTableMatchesSpec(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/dataplane.md")
	if err != nil {
		t.Fatal(err)
	}
	para := regexp.MustCompile(`(?s)\nScopes: (.*?)\n\n`).FindSubmatch(doc)
	if para == nil {
		t.Fatal("docs/dataplane.md has no \"Scopes:\" paragraph")
	}
	text := strings.Join(strings.Fields(string(para[1])), " ")
	if !strings.Contains(text, "`ping` needs none") {
		t.Errorf("the spec no longer says ping needs no scope: %q", text)
	}
	api, err := os.ReadFile("../docs/openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	scope := regexp.MustCompile(`(?m)^    Scope:\n(?:      .*\n)*?      description: '(.*)'$`).FindSubmatch(api)
	if scope == nil {
		t.Fatal("docs/openapi.yaml has no Scope schema with a one-line description")
	}
	for name, text := range map[string]string{"docs/dataplane.md": text, "docs/openapi.yaml": string(scope[1])} {
		checkScopeText(t, name, text)
	}
	for _, op := range []string{protocol.OpPing, protocol.OpCancel} {
		if dpOps[op].class != opInline {
			t.Errorf("%s must be answered by the reader (opInline)", op)
		}
	}
}

// checkScopeText checks that text ("`fs:read` covers stat, ls, ...; ...") gives each scope
// exactly the ops the op table gives it.
func checkScopeText(t *testing.T, doc, text string) {
	t.Helper()
	spec := map[string][]string{}
	for _, m := range regexp.MustCompile("`?([a-z:]+)`? covers ([a-z, ]+)[;.]").FindAllStringSubmatch(text, -1) {
		for _, op := range strings.Split(m[2], ",") {
			spec[m[1]] = append(spec[m[1]], strings.TrimSpace(op))
		}
	}
	table := map[string][]string{}
	for op, o := range dpOps {
		if o.class == opInline {
			if o.scope != "" || (o.inline == nil) == (o.control == nil) || o.run != nil {
				t.Errorf("%s: an inline op needs no scope and has only an inline or a control handler", op)
			}
			continue
		}
		if o.run == nil || o.inline != nil {
			t.Errorf("%s: a table entry other than inline has only a run handler", op)
		}
		table[o.scope] = append(table[o.scope], op)
	}
	for _, scope := range protocol.Scopes {
		slices.Sort(spec[scope])
		slices.Sort(table[scope])
		if !slices.Equal(spec[scope], table[scope]) {
			t.Errorf("scope %s: %s lists %v, the op table %v", scope, doc, spec[scope], table[scope])
		}
	}
	if got := slices.Sorted(maps.Keys(table)); !slices.Equal(got, slices.Sorted(slices.Values(protocol.Scopes))) {
		t.Errorf("the op table uses scopes %v; protocol defines %v", got, protocol.Scopes)
	}
}

// Every op of the table has a golden client frame in protocol/testdata/frames.json, the frames the
// Go and the TypeScript implementations both test against: an op added here without one fails.
func TestOpTableHasGoldenFrames(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../protocol/testdata/frames.json")
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Frames []struct {
			From string `json:"from"`
			Text struct {
				Op string `json:"op"`
			} `json:"text"`
			JSON struct {
				Op string `json:"op"`
			} `json:"json"`
		} `json:"frames"`
	}
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	golden := map[string]bool{}
	for _, f := range file.Frames {
		if f.From == "client" {
			golden[f.Text.Op], golden[f.JSON.Op] = true, true
		}
	}
	for _, op := range slices.Sorted(maps.Keys(dpOps)) {
		if !golden[op] {
			t.Errorf("op %q has no golden client frame in protocol/testdata/frames.json", op)
		}
	}
}

// An operation that panics is answered internal and logged with its stack; the broker, and the
// goroutine that ran it (a connection's reader, for some), go on.
func TestOpPanicIsAnsweredNotFatal(t *testing.T) {
	t.Parallel()
	var logged strings.Builder
	c := &dpConn{s: &Server{log: slog.New(slog.NewTextHandler(&logged, nil))}}
	boom := dpOp{class: opLight, run: func(context.Context, *dpConn, *request, json.RawMessage) (any, error) {
		var m map[string]int
		m["x"] = 1 // a nil map write: a runtime panic, as a bug would cause
		return nil, nil
	}}
	res, err, ran := c.run(context.Background(), &request{id: 7}, boom, nil, true)
	var pe *protocol.Error
	if !ran || res != nil || !errors.As(err, &pe) || pe.Code != protocol.CodeInternal {
		t.Fatalf("a panicking op: ran %v, %v, %v; want ran, no result, internal", ran, res, err)
	}
	if !strings.Contains(logged.String(), "dataplane operation panic") || !strings.Contains(logged.String(), "assignment to entry in nil map") {
		t.Fatalf("the panic is not in the log: %q", logged.String())
	}
}
