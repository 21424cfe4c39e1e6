package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

// docs/operations.md's "Every setting" table lists every flag of broker (serve) with its
// environment variable and its default, and no flag that does not exist: operators read it, not
// the source.
func TestOperationsDocumentsEveryFlag(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	// | `--flag` | `SBX_ENV` | default | what |
	row := regexp.MustCompile("(?m)^\\| `--([a-z-]+)` \\| `(SBX_[A-Z_]+)` \\| ([^|]*) \\|")
	type entry struct{ env, def string }
	documented := map[string]entry{}
	for _, m := range row.FindAllStringSubmatch(string(doc), -1) {
		documented[m[1]] = entry{m[2], strings.TrimSpace(m[3])}
	}
	if len(documented) == 0 {
		t.Fatal("docs/operations.md has no table of flags (| `--flag` | `SBX_ENV` | default | what |)")
	}
	root := rootCmd()
	root.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name == "help" || f.Name == "version" {
			return
		}
		d, ok := documented[f.Name]
		delete(documented, f.Name)
		switch {
		case !ok:
			t.Errorf("--%s is not in docs/operations.md's table of flags", f.Name)
		case d.env != envOf[f.Name]:
			t.Errorf("--%s: docs/operations.md names %s, the broker reads %s", f.Name, d.env, envOf[f.Name])
		case !sameDefault(f, d.def):
			t.Errorf("--%s: docs/operations.md says the default is %s, the broker's is %q", f.Name, d.def, f.DefValue)
		}
	})
	for name := range documented {
		t.Errorf("docs/operations.md documents --%s, which the broker does not have", name)
	}
}

// sameDefault says whether a table cell states flag f's default: a cell that is one `value` must
// be it (a duration in any spelling Go parses); a cell in words is for a flag whose default is
// empty, false or worked out at start (the data dir, as root or not).
func sameDefault(f *pflag.Flag, cell string) bool {
	m := regexp.MustCompile("^`([^`]*)`$").FindStringSubmatch(cell)
	if m == nil {
		return f.DefValue == "" || f.DefValue == "false" || f.DefValue == "[]" || f.Name == "data-dir"
	}
	if f.Value.Type() == "duration" {
		want, err1 := time.ParseDuration(f.DefValue)
		got, err2 := time.ParseDuration(m[1])
		return err1 == nil && err2 == nil && want == got
	}
	return m[1] == f.DefValue
}
