package client

import (
	"runtime/debug"
	"strings"
)

// Version describes the running binary for --version: the main module's
// version (a release tag, or "(devel)" for a build from a checkout), the VCS commit it was built
// from, whether the tree had uncommitted changes, and the Go version. It reads what the Go
// toolchain stamped into the binary (runtime/debug.ReadBuildInfo), so no build flags are needed.
func Version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown (built without module support)"
	}
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	var rev, modified, when string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		case "vcs.time":
			when = s.Value
		}
	}
	parts := []string{v}
	if rev != "" {
		c := "commit " + rev
		if modified == "true" {
			c += " (with uncommitted changes)"
		}
		if when != "" {
			c += " of " + when
		}
		parts = append(parts, c)
	} else {
		parts = append(parts, "commit unknown (built outside a git checkout, or with -buildvcs=false)")
	}
	parts = append(parts, bi.GoVersion)
	return strings.Join(parts, ", ")
}
