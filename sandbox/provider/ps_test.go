package provider

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// No process's command line names a sandbox's id or the data dir (bwrap takes its arguments from
// an fd), so `ps` tells other local users neither which sandboxes exist nor where their files are.
func TestNamespacePathsNotInPs(t *testing.T) {
	t.Parallel()
	n := newNamespace(t, Config{})
	_, spec := startSandbox(t, n, Template{})
	// A network sandbox has a pasta beside its bwrap.
	_, netSpec := startSandbox(t, n, Template{Network: NetworkOn})
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		if bytes.Contains(b, []byte(spec.ID)) || bytes.Contains(b, []byte(netSpec.ID)) || bytes.Contains(b, []byte(n.cfg.DataDir)) {
			t.Errorf("%s names the sandbox: %q", p, bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
		}
	}
}
