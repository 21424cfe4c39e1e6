// Package deps checks the module's layering (docs/ARCHITECTURE.md): data flows one way, cmd →
// server → domain packages → store; protocol is the wire format everyone shares and imports nothing
// of ours; the agent-side SDK (backend) and the Go SDK (client) speak to the broker only over the
// wire. A forbidden import, direct or through another package, fails the test with the chain that
// brings it in. Like tailscale's depaware and Coder's negative dependency tests, it keeps the
// layering true as the code grows.
package deps

import (
	"bufio"
	"bytes"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/sbxbroker/broker"

// serverSide are the broker's own packages (each with its subpackages): what runs inside the broker.
var serverSide = []string{"server", "store", "sandbox", "delegation", "heartbeat", "events"}

// rules say which packages (each with its subpackages) may not depend on which, and why.
var rules = []struct {
	from, forbid []string
	why          string
	// exceptFrom are packages of from that the rule does not apply to.
	exceptFrom []string
}{
	{[]string{"protocol"}, []string{""}, "protocol is the shared wire format and imports nothing of ours", nil},
	{[]string{"backend", "client"}, append([]string{"cmd"}, serverSide...), "the SDKs talk to the broker over the wire only", nil},
	{[]string{"mcp"}, []string{"cmd", "server", "store", "delegation", "heartbeat", "events", "sandbox"},
		"the MCP front end runs the dataplane's operations on the connection it is given (the wire in sbctl mcp, the broker's in-process connection on its endpoint), never on the broker's internals", nil},
	{[]string{"delegation", "heartbeat", "events", "sandbox", "store"}, []string{"server", "client", "backend", "cmd"},
		"domain packages sit under the HTTP layer and never call the broker over the wire", nil},
	{[]string{"store"}, []string{"server", "sandbox", "delegation", "heartbeat", "events", "client", "backend", "cmd"},
		"store is the bottom layer: everything else builds on it", nil},
	{[]string{"cmd/broker"}, []string{"client"}, "the broker does not use the SDK of its own API", nil},
	{[]string{"delegation", "heartbeat", "sandbox"}, []string{"events"},
		"domain packages emit through the function they are given (the server wires in the event log)", nil},
	{[]string{"cmd", "server", "store", "sandbox", "delegation", "heartbeat", "events", "backend", "client", "protocol", "mcp"},
		[]string{"server/servertest", "store/redistest", "tests/wait"}, "test helpers never link into the product",
		[]string{"server/servertest", "store/redistest", "tests/wait"}},
}

// directRules forbid a direct import only: the package may still depend on the other through a
// package that owns it.
var directRules = []struct {
	from, forbid []string
	why          string
	exceptFrom   []string
}{
	{[]string{"server"}, []string{"sandbox/provider", "sandbox/workspace"},
		"the server reaches a sandbox through the manager's runtime handle (sandbox.Runtime), never around it, so a sandbox whose files and processes are not on this host (a pod, a microVM) serves the same API",
		[]string{"server/servertest"}},
}

// knownViolations are the layering breaks that exist today, each to be removed by the change that
// fixes it (issue 16, item 8). The test fails when one is fixed and still listed, so this list can
// only shrink. Format: "from -> to" (module-relative import paths).
var knownViolations = map[string]string{
	// TODO(issue 16 item 8): backend.Local runs file operations through sandbox/workspace; the
	// agent-side SDK should take them from a package that is not the broker's.
	"backend -> sandbox/workspace": "backend.Local shares the broker's traversal-safe file operations",
	// TODO(issue 16 item 8): the broker writes sbctl's config file (client.WriteConfig) and parses
	// durations with client.Duration; both belong in a small package the two binaries share.
	"cmd/broker -> client": "the bootstrap config file and the duration flag",
}

// under reports whether the module-relative path p is pkg or inside it ("" is the whole module).
func under(p, pkg string) bool {
	return pkg == "" || p == pkg || strings.HasPrefix(p, pkg+"/")
}

func TestLayering(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	// imports is the module-relative import graph of non-test code.
	imports := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		from, ok := rel(f[0])
		if !ok {
			continue
		}
		imports[from] = nil
		for _, imp := range f[1:] {
			if to, ok := rel(imp); ok {
				imports[from] = append(imports[from], to)
			}
		}
	}
	if len(imports) < 10 {
		t.Fatalf("go list found only %d packages of the module: %s", len(imports), out)
	}
	found := map[string]bool{}
	for from := range imports {
		for to, chain := range reach(imports, from) {
			for _, r := range rules {
				if !anyUnder(from, r.from) || anyUnder(from, r.exceptFrom) || !anyUnder(to, r.forbid) || under(to, from) {
					continue
				}
				key := from + " -> " + to
				found[key] = true
				if _, known := knownViolations[key]; !known {
					t.Errorf("%s must not depend on %s (%s); the chain: %s", from, to, r.why, strings.Join(chain, " -> "))
				}
			}
		}
	}
	for from, direct := range imports {
		for _, to := range direct {
			for _, r := range directRules {
				if anyUnder(from, r.from) && !anyUnder(from, r.exceptFrom) && anyUnder(to, r.forbid) {
					t.Errorf("%s must not import %s (%s)", from, to, r.why)
				}
			}
		}
	}
	keys := make([]string, 0, len(knownViolations))
	for k := range knownViolations {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !found[k] {
			t.Errorf("known violation %q is gone: remove it from knownViolations", k)
		}
	}
}

func rel(p string) (string, bool) {
	if p == module {
		return "", true
	}
	r, ok := strings.CutPrefix(p, module+"/")
	return r, ok
}

func anyUnder(p string, pkgs []string) bool {
	for _, pkg := range pkgs {
		if under(p, pkg) {
			return true
		}
	}
	return false
}

// reach returns every package from depends on, directly or not, each with one import chain that
// leads to it (breadth first: the shortest).
func reach(imports map[string][]string, from string) map[string][]string {
	chains := map[string][]string{}
	queue := [][]string{{from}}
	for len(queue) > 0 {
		chain := queue[0]
		queue = queue[1:]
		for _, next := range imports[chain[len(chain)-1]] {
			if _, seen := chains[next]; seen || next == from {
				continue
			}
			c := append(append([]string(nil), chain...), next)
			chains[next] = c
			queue = append(queue, c)
		}
	}
	return chains
}

// initForbidden are packages the resident init must not link: each one grows every sandbox's pid 1,
// and os/user and net pull in cgo, which makes the binary need the host's libc (a template's own
// rootfs may have none).
var initForbidden = []string{
	"gopkg.in/yaml", "go.yaml.in/yaml", "sigs.k8s.io/yaml", "regexp", "os/user", "net", "runtime/cgo",
	module + "/server", module + "/store", module + "/delegation", module + "/heartbeat", module + "/events",
	module + "/protocol",
}

// initMaxSize bounds bin/sbx-init (3.4 MiB when the init became a leaf package; 4.7 MiB before,
// with YAML, regexp and cgo linked in).
const initMaxSize = 4 << 20

// TestInitIsLeaf: cmd/sbx-init links only the init (sandbox/provider/sbxinit) and is a small static
// binary whatever CGO_ENABLED the builder has, so it runs in any template's rootfs.
func TestInitIsLeaf(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", module+"/cmd/sbx-init").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		for _, f := range initForbidden {
			if p == f || strings.HasPrefix(p, f+"/") {
				t.Errorf("cmd/sbx-init links %s; the init must stay a leaf (see sandbox/provider/sbxinit)", p)
			}
		}
		if r, ok := rel(p); ok && r != "cmd/sbx-init" && !under(r, "sandbox/provider/sbxinit") {
			t.Errorf("cmd/sbx-init links %s: it may link nothing of the broker's but sandbox/provider/sbxinit", r)
		}
	}

	// Built as a developer would, with the environment's CGO_ENABLED (1 where gcc is installed):
	// static only if nothing it links uses cgo. The repo's scripts build it with CGO_ENABLED=0 too.
	bin := filepath.Join(t.TempDir(), "sbx-init")
	build := exec.Command("go", "build", "-o", bin, module+"/cmd/sbx-init")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build cmd/sbx-init: %v\n%s", err, b)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("sbx-init has a program interpreter (PT_INTERP): it is dynamically linked and fails in a rootfs without libc")
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("sbx-init needs shared libraries %v (%v): it must be static", libs, err)
	}
	st, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("sbx-init: %d bytes", st.Size())
	if st.Size() > initMaxSize {
		t.Errorf("sbx-init is %d bytes, more than %d: what made it grow?", st.Size(), initMaxSize)
	}
}

// redisClient is the Redis client library. Only store issues Redis commands (docs/ARCHITECTURE.md,
// "All Redis behind store"), so its test matrix covers every one; the others listed here build a
// client to hand to store, or are test helpers that damage Redis on purpose.
const redisClient = "github.com/redis/go-redis/v9"

var mayImportRedis = map[string]string{
	"store":             "the one owner of Redis",
	"store/redistest":   "test helper: starts redis-server and Cluster for tests",
	"server/servertest": "test helper: tests damage records through a raw client",
	"cmd/broker":        "builds the client (URL, embedded, bounds) that it hands to store",
	"tests/bench":       "builds a client for its embedded Redis and hands it to store",
}

func TestOnlyStoreImportsRedis(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	seen := 0
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		from, ok := rel(f[0])
		if !ok {
			continue
		}
		for _, imp := range f[1:] {
			if imp != redisClient && !strings.HasPrefix(imp, redisClient+"/") {
				continue
			}
			seen++
			if _, ok := mayImportRedis[from]; !ok {
				t.Errorf("%s imports %s: Redis calls belong in store (add a method there and test it in its matrix)", from, imp)
			}
		}
	}
	if seen == 0 {
		t.Fatal("no package imports the Redis client: is the list broken?")
	}
}
