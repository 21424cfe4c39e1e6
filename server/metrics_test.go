package server_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// getMetrics fetches /metrics with the given Authorization header ("" sends none).
func getMetrics(t *testing.T, b *servertest.Broker, auth string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, b.URL+"/metrics", nil)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// /metrics answers on the API's own listener, which every tenant reaches without credentials: it
// must not name the orgs on the broker nor show their activity. The series labelled with an org are
// served only with the operator's metrics token; everything else stays public for scrapers; a wrong
// token is refused (and counted as a failed authentication), never echoed.
func TestMetricsNameNoOrgWithoutTheOperatorsToken(t *testing.T) {
	t.Parallel()
	const token = "operator-metrics-token-0123456789"
	b := servertest.New(t, servertest.Options{MetricsToken: token, AuthFailures: 2, AuthFailureWindow: time.Minute})
	ctx := b.Client
	secret := b.NewClient("acme-secret-customer")
	if _, err := secret.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "project-x"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctx.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "mine"}); err != nil {
		t.Fatal(err)
	}

	status, public := getMetrics(t, b, "")
	if status != http.StatusOK || !strings.Contains(public, "sbx_provider_info") || !strings.Contains(public, "sbx_http_requests_total") {
		t.Fatalf("public /metrics: %d, want 200 with the series that name no org:\n%.2000s", status, public)
	}
	for _, leak := range []string{"acme-secret-customer", `org="`, "sbx_org_running_sandboxes"} {
		if strings.Contains(public, leak) {
			t.Errorf("public /metrics holds %q: any caller learns the orgs on this broker", leak)
		}
	}

	status, full := getMetrics(t, b, "Bearer "+token)
	if status != http.StatusOK || !strings.Contains(full, `sbx_org_running_sandboxes{org="acme-secret-customer"} 1`) {
		t.Fatalf("/metrics with the operator's token: %d, want the per-org series:\n%.3000s", status, full)
	}

	// A tenant's own API key is not the metrics token: it would show the tenant the other orgs.
	for i, auth := range []string{"Bearer " + secret.APIKey(), "Bearer wrong-token-wrong-token", "Basic " + token} {
		status, body := getMetrics(t, b, auth)
		var eb protocol.ErrorBody
		json.Unmarshal([]byte(body), &eb)
		want := http.StatusUnauthorized
		if i == 2 {
			want = http.StatusTooManyRequests // the third failure from this address within the window
		}
		if status != want || strings.Contains(body, "acme") || strings.Contains(body, secret.APIKey()) || strings.Contains(body, token) {
			t.Errorf("/metrics with %.12s...: %d %s, want %d naming no org and echoing no credential", auth, status, body, want)
		}
		if i == 2 && !strings.Contains(eb.Error.Message, "--metrics-token-file") {
			t.Errorf("the refusal of a source past its failures should name the metrics token: %q", eb.Error.Message)
		}
		if i < 2 && eb.Error.Code != protocol.CodeUnauthenticated {
			t.Errorf("/metrics with %.12s...: code %q, want %s", auth, eb.Error.Code, protocol.CodeUnauthenticated)
		}
	}
}

// Without a metrics token configured nobody gets the per-org series, and asking with a credential
// says how to configure one.
func TestMetricsWithoutATokenConfigured(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	if status, body := getMetrics(t, b, ""); status != http.StatusOK || strings.Contains(body, `org="`) {
		t.Fatalf("public /metrics: %d, per-org series present: %v", status, strings.Contains(body, `org="`))
	}
	status, body := getMetrics(t, b, "Bearer "+b.Client.APIKey())
	if status != http.StatusUnauthorized || !strings.Contains(body, "--metrics-token-file") || strings.Contains(body, b.Client.APIKey()) {
		t.Fatalf("/metrics with a credential on a broker without a metrics token: %d %s", status, body)
	}
}

// The provider's part of creates is counted once per sandbox it started: a reuse starts nothing.
func TestMetricsProviderStarts(t *testing.T) {
	t.Parallel()
	b := servertest.New(t, servertest.Options{})
	for _, name := range []string{"a", "a", "b"} {
		if _, err := b.Client.CreateSandbox(t.Context(), protocol.CreateSandboxRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	_, body := getMetrics(t, b, "")
	if !strings.Contains(body, "\nsbx_provider_starts_total 2\n") {
		t.Errorf("want sbx_provider_starts_total 2 after two creates and a reuse:\n%.3000s", body)
	}
	if strings.Contains(body, "\nsbx_provider_start_seconds_total 0\n") || !strings.Contains(body, "\nsbx_provider_start_seconds_total ") {
		t.Errorf("want a start time in sbx_provider_start_seconds_total:\n%.3000s", body)
	}
}
