package server_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/client"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// How isolated a sandbox is shows on every answer that carries it, and the broker's /readyz and
// /metrics say which provider runs sandboxes and whether limits hold.
func TestIsolationIsVisible(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		provider, isolation string
		limits              bool
	}{
		{provider: "dir", isolation: protocol.IsolationNone},
		{provider: "namespace", isolation: protocol.IsolationNamespace, limits: true},
	} {
		t.Run(tc.provider, func(t *testing.T) {
			t.Parallel()
			b := servertest.New(t, servertest.Options{Provider: tc.provider})
			ctx := context.Background()
			res, err := b.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "iso"})
			if err != nil {
				t.Fatal(err)
			}
			got, err := b.Client.GetSandbox(ctx, "iso")
			if err != nil {
				t.Fatal(err)
			}
			list, err := b.Client.ListAllSandboxes(ctx, client.ListOptions{})
			if err != nil || len(list) != 1 {
				t.Fatal(list, err)
			}
			for what, sb := range map[string]protocol.Sandbox{"create": res.Sandbox, "get": got, "list": list[0]} {
				if sb.Isolation != tc.isolation {
					t.Errorf("%s: isolation %q, want %q", what, sb.Isolation, tc.isolation)
				}
			}

			spec, err := servertest.LoadSpec()
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.Get(b.URL + "/readyz")
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err := spec.CheckResponse("GET", "/readyz", resp.StatusCode, resp.Header.Get("Content-Type"), raw); err != nil {
				t.Error(err)
			}
			var ready struct {
				Provider       string `json:"provider"`
				Isolation      string `json:"isolation"`
				LimitsEnforced *bool  `json:"limits_enforced"`
				DiskQuota      *bool  `json:"disk_quota"`
			}
			json.Unmarshal(raw, &ready)
			// The tests run as root, where a namespace broker gives each sandbox a filesystem.
			if ready.Provider != tc.provider || ready.Isolation != tc.isolation || ready.LimitsEnforced == nil || *ready.LimitsEnforced != tc.limits ||
				ready.DiskQuota == nil || *ready.DiskQuota != tc.limits {
				t.Errorf("/readyz: %s", raw)
			}

			resp, err = http.Get(b.URL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			raw, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			limits := "0"
			if tc.limits {
				limits = "1"
			}
			for _, want := range []string{
				`sbx_provider_info{isolation="` + tc.isolation + `",provider="` + tc.provider + `"} 1`,
				"sbx_provider_limits_enforced " + limits,
			} {
				if !strings.Contains(string(raw), "\n"+want+"\n") {
					t.Errorf("/metrics lacks %q", want)
				}
			}
		})
	}
}

// A sandbox brought back by a broker that runs another provider (a data dir moved to dir with
// --allow-unisolated) says what runs it now, not what ran it when it was created.
func TestIsolationFollowsTheProviderThatRunsIt(t *testing.T) {
	t.Parallel()
	first := servertest.New(t, servertest.Options{Provider: "namespace"})
	ctx := context.Background()
	if _, err := first.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "moved"}); err != nil {
		t.Fatal(err)
	}
	first.Stop()
	second := servertest.New(t, servertest.Options{Provider: "dir", Redis: first.Redis, DataDir: first.DataDir, Node: "node-test"})
	c := second.NewClient(first.Org)
	got, err := c.GetSandbox(ctx, "moved")
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != protocol.StatusRunning || got.Provider != "dir" || got.Isolation != protocol.IsolationNone {
		t.Errorf("after the restart on dir: status %s, provider %s, isolation %s", got.Status, got.Provider, got.Isolation)
	}
}
