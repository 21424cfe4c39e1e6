package tests

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/tests/wait"
)

// runscSandboxPids are the host pids of gVisor sentries (runsc-sandbox) whose command line names id.
func runscSandboxPids(id string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(b, []byte(id)) && bytes.Contains(b, []byte("runsc")) {
			out = append(out, pid)
		}
	}
	return out
}

func (b *broker) sandbox(ref string) protocol.Sandbox {
	b.t.Helper()
	var sb protocol.Sandbox
	if err := json.Unmarshal([]byte(b.ok("get", ref, "-o", "json")), &sb); err != nil {
		b.t.Fatalf("get %s -o json: %v", ref, err)
	}
	return sb
}

// A gvisor template end to end through the real binaries: the level is chosen per template (or per
// create), reported everywhere, and a gvisor sandbox behaves as a namespace one does: exec, files
// both ways, limits, stop and resume at the same level, leases, the loss of its runtime, delete
// leaving nothing behind. Levels the host cannot give are refused, never weakened.
func TestGvisorLevelEndToEnd(t *testing.T) {
	runsc, err := provider.FindRunsc("")
	if err != nil {
		t.Fatalf("the gvisor level needs runsc: %v (run scripts/runsc.sh)", err)
	}
	dir := t.TempDir()
	tmpl := filepath.Join(dir, "templates.yaml")
	templates := "- name: untrusted\n  isolation: gvisor\n  limits: {memory_bytes: 536870912, pids: 128}\n" +
		"- name: pooled\n  pool: {size: 1}\n" +
		"- name: gvpooled\n  isolation: gvisor\n  pool: {size: 1}\n"
	if err := os.WriteFile(tmpl, []byte(templates), 0o644); err != nil {
		t.Fatal(err)
	}
	// The broker's HOME is a temp dir, so it would not find the cached runsc itself.
	b := startBroker(t, "--templates", tmpl, "--runsc", runsc)

	t.Run("levels on readyz and metrics", func(t *testing.T) {
		var ready struct {
			Levels []struct {
				Level     string
				Available bool
				Missing   string
			} `json:"isolation_levels"`
		}
		raw := get(t, b.URL+"/readyz")
		if err := json.Unmarshal([]byte(raw), &ready); err != nil {
			t.Fatal(err)
		}
		got := map[string]bool{}
		for _, l := range ready.Levels {
			got[l.Level] = l.Available
		}
		if !got["namespace"] || !got["gvisor"] || got["microvm"] || len(got) != 3 {
			t.Errorf("/readyz levels: %s", raw)
		}
		if !strings.Contains(b.log.String(), "namespace,gvisor") {
			t.Errorf("the start-up log does not list the levels offered:\n%s", tailLines(b.log.String(), 20))
		}
		metrics := get(t, b.URL+"/metrics")
		for _, want := range []string{`sbx_isolation_level_available{level="gvisor"} 1`, `sbx_isolation_level_available{level="microvm"} 0`} {
			if !strings.Contains(metrics, want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
	})
	t.Run("refusals", func(t *testing.T) {
		r := b.sbctl("create", "vm", "--isolation", "microvm")
		if r.code == 0 || !strings.Contains(r.stderr, "/dev/kvm") {
			t.Errorf("microvm: exit %d %q", r.code, r.stderr)
		}
		r = b.sbctl("create", "weaker", "--template", "untrusted", "--isolation", "namespace")
		if r.code == 0 || !strings.Contains(r.stderr, "not lower") {
			t.Errorf("lowering the template's level: exit %d %q", r.code, r.stderr)
		}
		if got := b.ok("list", "-o", "json"); strings.Contains(got, "weaker") || strings.Contains(got, `"vm"`) {
			t.Errorf("a refused create left a sandbox: %s", got)
		}
	})

	b.ok("create", "gv", "--template", "untrusted")
	sb := b.sandbox("gv")
	if sb.Isolation != "gvisor" || sb.Provider != "gvisor" {
		t.Fatalf("gvisor sandbox view: isolation %q provider %q", sb.Isolation, sb.Provider)
	}
	t.Run("per create", func(t *testing.T) {
		b.ok("create", "raised", "--isolation", "gvisor")
		if s := b.sandbox("raised"); s.Isolation != "gvisor" {
			t.Errorf("--isolation gvisor on the default template: %q", s.Isolation)
		}
		// The level is the sandbox's, recorded at create: a resume keeps it though the template
		// (default) says namespace.
		b.ok("stop", "raised")
		b.ok("resume", "raised")
		if s := b.sandbox("raised"); s.Isolation != "gvisor" {
			t.Errorf("resumed at %q", s.Isolation)
		}
		if out := b.ok("exec", "raised", "--", "uname", "-r"); !strings.Contains(out, "gvisor") {
			t.Errorf("uname -r after a resume: %q", out)
		}
		b.ok("delete", "raised", "--yes")
	})
	t.Run("warm pools keep the level", func(t *testing.T) {
		// A pooled namespace sandbox is never handed to a create that asked for gvisor, and a
		// gvisor template's pooled sandbox is recorded (and resumed) as gvisor.
		for _, tmpl := range []string{"pooled", "gvpooled"} {
			wait.Eventually(t, 30*time.Second, func() bool {
				return strings.Contains(get(t, b.URL+"/metrics"), `sbx_pool_ready{template="`+tmpl+`"} 1`)
			}, "the %s pool to fill", tmpl)
		}
		b.ok("create", "from-ns-pool", "--template", "pooled", "--isolation", "gvisor")
		b.ok("create", "from-gv-pool", "--template", "gvpooled")
		for _, name := range []string{"from-ns-pool", "from-gv-pool"} {
			if s := b.sandbox(name); s.Isolation != "gvisor" || s.Provider != "gvisor" {
				t.Errorf("%s: isolation %q provider %q", name, s.Isolation, s.Provider)
			}
			if out := b.ok("exec", name, "--", "uname", "-r"); !strings.Contains(out, "gvisor") {
				t.Errorf("%s: uname -r %q", name, out)
			}
			b.ok("delete", name, "--yes")
		}
		if !strings.Contains(get(t, b.URL+"/metrics"), `sbx_pool_claims_total{template="gvpooled"} 1`) {
			t.Error("the gvisor template's create did not come from its pool")
		}
	})
	t.Run("exec and files both ways", func(t *testing.T) {
		if out := b.ok("exec", "gv", "--", "sh", "-c", "uname -r; echo made-inside > inside.txt"); !strings.Contains(out, "gvisor") {
			t.Errorf("uname -r: %q", out)
		}
		local := filepath.Join(dir, "local.txt")
		os.WriteFile(local, []byte("from the client\n"), 0o644)
		b.ok("cp", local, "gv:/workspace/up.txt")
		if out := b.ok("exec", "gv", "--", "cat", "up.txt"); out != "from the client\n" {
			t.Errorf("the sandbox reads the uploaded file: %q", out)
		}
		b.ok("cp", "gv:/workspace/inside.txt", filepath.Join(dir, "down.txt"))
		if got, _ := os.ReadFile(filepath.Join(dir, "down.txt")); string(got) != "made-inside\n" {
			t.Errorf("the broker reads the file made inside: %q", got)
		}
	})
	t.Run("limits", func(t *testing.T) {
		// Past the template's 512 MiB the memory limit's OOM killer takes the sentry: the sandbox
		// stops with memory_limit, files kept, and resumes.
		b.sbctl("exec", "gv", "--", "python3", "-c", "b = bytearray(700 << 20); print('allocated')")
		wait.Eventually(t, 20*time.Second, func() bool { return b.sandbox("gv").StopReason == protocol.StopMemoryLimit },
			"the sandbox stopped with memory_limit after 700 MiB under 512 MiB")
		b.ok("resume", "gv")
		if out := b.ok("exec", "gv", "--", "cat", "inside.txt"); out != "made-inside\n" {
			t.Errorf("after the memory limit and a resume: %q", out)
		}
	})
	t.Run("stop keeps files, resume keeps the level", func(t *testing.T) {
		b.ok("stop", "gv")
		id := b.sandbox("gv").ID
		wait.Eventually(t, 10*time.Second, func() bool { return len(runscSandboxPids(id)) == 0 }, "runsc processes of a stopped sandbox to end")
		b.ok("resume", "gv")
		if s := b.sandbox("gv"); s.Isolation != "gvisor" {
			t.Errorf("resumed at %q", s.Isolation)
		}
		if out := b.ok("exec", "gv", "--", "cat", "inside.txt"); out != "made-inside\n" {
			t.Errorf("after resume: %q", out)
		}
	})
	t.Run("a lost sentry stops the sandbox with runtime_lost", func(t *testing.T) {
		id := b.sandbox("gv").ID
		killed := 0
		for _, pid := range runscSandboxPids(id) {
			cmdline, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
			if bytes.HasPrefix(cmdline, []byte("runsc-sandbox")) {
				if p, err := os.FindProcess(pid); err == nil && p.Kill() == nil {
					killed++
				}
			}
		}
		if killed == 0 {
			t.Fatal("no runsc-sandbox process found")
		}
		wait.Eventually(t, 20*time.Second, func() bool { return b.sandbox("gv").StopReason == protocol.StopRuntimeLost }, "the sandbox stopped with runtime_lost")
		if r := b.sbctl("exec", "gv", "--", "true"); r.code == 0 {
			t.Error("exec in a lost sandbox succeeded")
		}
		b.ok("resume", "gv")
		if out := b.ok("exec", "gv", "--", "cat", "inside.txt"); out != "made-inside\n" {
			t.Errorf("after the loss and a resume: %q", out)
		}
	})
	t.Run("lease runs out", func(t *testing.T) {
		b.ok("create", "leased", "--template", "untrusted", "--ttl", "3s")
		wait.Eventually(t, 20*time.Second, func() bool { return b.sandbox("leased").StopReason == protocol.StopTTLExpired }, "the lease of a gvisor sandbox ran out")
	})
	t.Run("delete leaves nothing", func(t *testing.T) {
		id := b.sandbox("gv").ID
		b.ok("delete", "gv", "--yes")
		wait.Eventually(t, 10*time.Second, func() bool { return len(runscSandboxPids(id)) == 0 }, "runsc processes of a deleted sandbox to end")
		if _, err := os.Stat(filepath.Join(b.DataDir, "sandboxes", id)); !os.IsNotExist(err) {
			t.Errorf("the deleted sandbox's directory is still there: %v", err)
		}
	})
}
