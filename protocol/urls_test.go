package protocol_test

import (
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

// A broker base URL is checked and normalised in one place, whatever case its scheme is in, and the
// dataplane URL is built from it by one function.
func TestBrokerBaseAndDataplaneURL(t *testing.T) {
	for in, want := range map[string]string{
		"http://broker:7070":         "http://broker:7070",
		"HTTPS://Broker.example:443": "https://Broker.example:443",
		"Https://b.example/":         "https://b.example",
		"http://[::1]:7070":          "http://[::1]:7070",
	} {
		got, err := protocol.BrokerBaseURL(in)
		if err != nil || got != want {
			t.Errorf("BrokerBaseURL(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "broker:7070", "ftp://b", "ws://b", "http://", "http://u:p@b", "http://b/prefix",
		"http://b?x=1", "http://b#f", "http://b\n", " http://b"} {
		if got, err := protocol.BrokerBaseURL(in); err == nil {
			t.Errorf("BrokerBaseURL(%q) = %q, want an error", in, got)
		} else if !strings.Contains(err.Error(), "http://") {
			t.Errorf("BrokerBaseURL(%q): %q does not say what a good one looks like", in, err)
		}
	}
	id := protocol.NewSandboxID()
	for base, want := range map[string]string{
		"http://h:1":         "ws://h:1/v1/sandboxes/" + id + "/dataplane",
		"HTTPS://H:2":        "wss://H:2/v1/sandboxes/" + id + "/dataplane",
		"https://h/":         "wss://h/v1/sandboxes/" + id + "/dataplane",
		"http://[::1]:7070/": "ws://[::1]:7070/v1/sandboxes/" + id + "/dataplane",
	} {
		got, err := protocol.DataplaneURL(base, id)
		if err != nil || got != want {
			t.Errorf("DataplaneURL(%q) = %q, %v; want %q", base, got, err, want)
		}
	}
	if got, err := protocol.DataplaneURL("gopher://h", id); err == nil {
		t.Errorf("DataplaneURL of a gopher base = %q", got)
	}
}

// Sandbox ids are minted and recognised in one place: "sb_" and a canonical UUID, nothing that
// could name a path.
func TestSandboxIDs(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 100; i++ {
		id := protocol.NewSandboxID()
		if !protocol.ValidSandboxID(id) || seen[id] {
			t.Fatalf("minted %q: valid %v, seen %v", id, protocol.ValidSandboxID(id), seen[id])
		}
		seen[id] = true
	}
	for _, bad := range []string{"", "sb_", "sb_x", "dev", "sb_../../etc", "SB_0f9c2b1e-4a5d-4c3e-9b7a-1d2e3f4a5b6c",
		"sb_0f9c2b1e-4a5d-4c3e-9b7a-1d2e3f4a5b6", "sb_0f9c2b1e-4a5d-4c3e-9b7a-1d2e3f4a5b6cc", "sb_0f9c2b1e/4a5d-4c3e-9b7a-1d2e3f4a5b6c",
		"sb_0f9c2b1e-4a5d-4c3e-9b7a-1d2e3f4a5b6g"} {
		if protocol.ValidSandboxID(bad) {
			t.Errorf("ValidSandboxID(%q) = true", bad)
		}
	}
	if !protocol.ValidSandboxID("sb_0f9c2b1e-4a5d-4c3e-9b7a-1d2e3f4a5b6c") {
		t.Error("a canonical id is refused")
	}
}

func TestMCPURLOf(t *testing.T) {
	for in, want := range map[string]string{
		"ws://127.0.0.1:7070/v1/sandboxes/sb_1/dataplane":         "http://127.0.0.1:7070/v1/sandboxes/sb_1/mcp",
		"wss://broker.example/prefix/v1/sandboxes/sb_1/dataplane": "https://broker.example/prefix/v1/sandboxes/sb_1/mcp",
		"WSS://broker.example/v1/sandboxes/a%2Fb/dataplane":       "https://broker.example/v1/sandboxes/a%2Fb/mcp",
		"http://broker.example/v1/sandboxes/sb_1/dataplane":       "",
		"ws://broker.example/v1/sandboxes/sb_1/events":            "",
		"ws://broker.example/v1/sandboxes/sb_1/dataplane?token=x": "",
		"": "",
	} {
		if got := protocol.MCPURLOf(in); got != want {
			t.Errorf("protocol.MCPURLOf(%q) = %q, want %q", in, got, want)
		}
	}
}
