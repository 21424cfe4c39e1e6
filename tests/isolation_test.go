package tests

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// get fetches a broker endpoint and returns its body.
func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return string(raw)
}

// On a host that cannot run namespace sandboxes (here: no bwrap on the broker's PATH) a first start
// falls back to the dir provider, and says so everywhere: a banner at start, /readyz, /metrics,
// the sandbox's isolation field and a warning from sbctl create. Its commands still never run as
// root.
func TestFallbackIsLoudAndNeverRoot(t *testing.T) {
	noBwrap := t.TempDir()
	redis, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(redis, filepath.Join(noBwrap, "redis-server")); err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	os.Chmod(filepath.Dir(home), 0o711)
	os.Chmod(home, 0o711)
	b := &broker{t: t, Home: home, DataDir: filepath.Join(home, "data"), provider: "dir", env: []string{"PATH=" + noBwrap}}
	b.start()
	t.Cleanup(b.stop)

	for _, want := range []string{"SANDBOXES ARE NOT ISOLATED", "bwrap not found", "--provider-reset"} {
		if !strings.Contains(b.log.String(), want) {
			t.Errorf("the start-up log lacks %q:\n%s", want, b.log)
		}
	}
	var ready struct {
		Provider, Isolation, Fallback string
		LimitsEnforced                bool `json:"limits_enforced"`
	}
	raw := get(t, b.URL+"/readyz")
	if err := json.Unmarshal([]byte(raw), &ready); err != nil || ready.Isolation != "none" || ready.LimitsEnforced || !strings.Contains(ready.Fallback, "bwrap not found") {
		t.Errorf("/readyz: %s", raw)
	}
	metrics := get(t, b.URL+"/metrics")
	for _, want := range []string{`sbx_provider_info{isolation="none",provider="dir"} 1`, "sbx_provider_limits_enforced 0", "sbx_provider_fallback 1"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	r := b.sbctl("create", "dev", "-o", "json")
	if r.code != 0 || !strings.Contains(r.stderr, "warning: sandbox dev is not isolated") || !strings.Contains(r.stdout, `"isolation": "none"`) {
		t.Fatalf("create: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	if uid := strings.TrimSpace(b.ok("exec", "dev", "--", "id", "-u")); uid == "0" || uid == "" {
		t.Errorf("a dir sandbox runs commands as uid %q", uid)
	}
	if r := b.sbctl("exec", "dev", "--", "cat", "/etc/shadow"); r.code == 0 {
		t.Errorf("a dir sandbox read /etc/shadow:\n%s", r.stdout)
	}

	// Every later start keeps the dir provider (auto never changes a data dir's provider by
	// itself) and still says why it is there.
	b.restart()
	if !strings.Contains(b.log.String(), "SANDBOXES ARE NOT ISOLATED") || !strings.Contains(b.log.String(), "bwrap not found") {
		t.Errorf("the restart's log does not say why sandboxes are not isolated:\n%s", b.log)
	}
	raw = get(t, b.URL+"/readyz")
	if err := json.Unmarshal([]byte(raw), &ready); err != nil || ready.Isolation != "none" || !strings.Contains(ready.Fallback, "bwrap not found") {
		t.Errorf("/readyz after a restart: %s", raw)
	}
}

// A namespace broker says its sandboxes are isolated, and sbctl create warns about nothing.
func TestIsolatedIsReported(t *testing.T) {
	b := startBroker(t)
	r := b.sbctl("create", "dev", "-o", "json")
	if r.code != 0 || strings.Contains(r.stderr, "not isolated") || !strings.Contains(r.stdout, `"isolation": "namespace"`) {
		t.Fatalf("create: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	if raw := get(t, b.URL+"/readyz"); !strings.Contains(raw, `"isolation":"namespace"`) || !strings.Contains(raw, `"limits_enforced":true`) {
		t.Errorf("/readyz: %s", raw)
	}
	if strings.Contains(b.log.String(), "NOT ISOLATED") {
		t.Errorf("an isolated broker's log warns:\n%s", b.log)
	}
}
