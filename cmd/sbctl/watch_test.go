package main

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// The lease column counts down and turns into a warning ("!") within a fifth of the TTL (10 s to
// 5 min), or once the broker sent its expiring warning; a stopped sandbox has no lease.
func TestWatchLeaseWarning(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	m := newWatchModel(t.Context(), nil, "http://b", "", nil)
	m.now = func() time.Time { return now }
	at := func(d time.Duration) *time.Time { x := now.Add(d); return &x }
	for _, tc := range []struct {
		s    protocol.Sandbox
		want string
		warn bool
	}{
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 1800, ExpiresAt: at(29*time.Minute + 59*time.Second)}, "29m59s", false},
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 1800, ExpiresAt: at(5*time.Minute + time.Second)}, "5m01s", false},
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 1800, ExpiresAt: at(5 * time.Minute)}, "!5m00s", true},
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 60, ExpiresAt: at(12 * time.Second)}, "!12s", true},
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 7200, ExpiresAt: at(2 * time.Hour)}, "2h00m", false},
		{protocol.Sandbox{ID: "a", Status: "running", TTLSeconds: 7200, ExpiresAt: at(-time.Second)}, "!0s", true},
		{protocol.Sandbox{ID: "a", Status: "stopped", TTLSeconds: 60}, "-", false},
		{protocol.Sandbox{ID: "w", Status: "running", TTLSeconds: 7200, ExpiresAt: at(time.Hour)}, "!1h00m", true},
	} {
		m.expiring = map[string]time.Time{"w": now.Add(time.Hour)}
		got, warn := m.lease(tc.s)
		if got != tc.want || warn != tc.warn {
			t.Errorf("%+v: %q %v, want %q %v", tc.s, got, warn, tc.want, tc.warn)
		}
	}
}

// Whatever a sandbox's name, tags or events hold, the screen carries no control character but the
// line breaks (and the styles' own escapes, which start with ESC [ and are not from the data).
func TestWatchViewEscapesData(t *testing.T) {
	m := newWatchModel(t.Context(), nil, "http://b", "", nil)
	m.loaded = true
	evil := "x\x1b]52;c;cHduZWQ=\x07\r\u202e\x9b"
	m.sandboxes = []protocol.Sandbox{{ID: "sb_1", Name: "n" + evil, Status: "running" + evil, Isolation: evil,
		Tags: map[string]string{"k" + evil: "v" + evil}, DataplaneURL: "ws://h" + evil}}
	m.selected = "sb_1"
	m.events = []protocol.Event{{Type: "exec" + evil, SandboxID: "sb_1", Name: evil, Command: evil, Path: evil, Reason: evil}}
	m.status = evil
	m.allEvents = true
	for _, w := range []int{80, 200} {
		m.width, m.height = w, 24
		v := m.View()
		plain := regexp.MustCompile("\x1b\\[[0-9;]*m").ReplaceAllString(v, "")
		for _, r := range plain {
			if (r < 0x20 && r != '\n') || r == 0x7f || (r >= 0x80 && r <= 0x9f) || r == '\u202e' {
				t.Fatalf("a control character %U reached the screen:\n%q", r, v)
			}
		}
		if !strings.Contains(plain, `\x1b]52`) {
			t.Fatalf("the escaped data is not shown:\n%s", plain)
		}
	}
}

// A pod sandbox's NODE column is the cluster node it runs on, not the broker that reaches it (and a
// node name from the cluster is escaped like any data).
func TestWatchShowsWhereAPodRuns(t *testing.T) {
	m := newWatchModel(t.Context(), nil, "http://b", "", nil)
	m.loaded = true
	m.width, m.height = 120, 24
	m.sandboxes = []protocol.Sandbox{
		{ID: "sb_1", Name: "pod-box", Status: "running", Isolation: "container", DataplaneURL: "ws://broker-a:7070/v1/sandboxes/sb_1/dataplane",
			Placement: &protocol.Placement{Node: "worker-7\x1b", Pod: "sbx/sbx-1"}},
		{ID: "sb_2", Name: "local-box", Status: "running", Isolation: "namespace", DataplaneURL: "ws://broker-a:7070/v1/sandboxes/sb_2/dataplane"},
	}
	v := regexp.MustCompile("\x1b\\[[0-9;]*m").ReplaceAllString(m.View(), "")
	var pod, local string
	for _, line := range strings.Split(v, "\n") {
		switch {
		case strings.Contains(line, "pod-box"):
			pod = line
		case strings.Contains(line, "local-box"):
			local = line
		}
	}
	if !strings.Contains(pod, "worker-7") || strings.Contains(pod, "broker-a") || !strings.Contains(local, "broker-a:7070") {
		t.Errorf("NODE column:\n%s\n%s", pod, local)
	}
}

// With a tag filter, the org's events pane shows only the listed sandboxes' events; the selected
// sandbox's pane shows only its own.
func TestWatchEventsFollowTheFilter(t *testing.T) {
	m := newWatchModel(t.Context(), nil, "http://b", "", map[string]string{"team": "web"})
	m.loaded = true
	m.sandboxes = []protocol.Sandbox{{ID: "sb_ci", Name: "ci", Status: "running"}, {ID: "sb_web", Name: "web", Status: "running"}}
	m.selected = "sb_ci"
	m.events = []protocol.Event{
		{Type: "created", SandboxID: "sb_ci", Name: "ci"},
		{Type: "created", SandboxID: "sb_dev", Name: "dev"},
		{Type: "created", SandboxID: "sb_web", Name: "web"},
	}
	v := m.View()
	if !strings.Contains(v, "ci  created") || !strings.Contains(v, "web  created") || strings.Contains(v, "dev  created") {
		t.Fatalf("filtered org pane:\n%s", v)
	}
	m.allEvents = false
	v = m.View()
	if !strings.Contains(v, "events: ci ") || strings.Count(v, "created") != 1 {
		t.Fatalf("selected sandbox's pane:\n%s", v)
	}
}
