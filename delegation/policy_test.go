package delegation

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/sbxbroker/broker/protocol"
)

func TestCheckCommand(t *testing.T) {
	t.Parallel()
	pytest := []string{"pytest"}
	both := []string{"pytest", "python"}
	cases := []struct {
		name    string
		allow   []string
		command string
		argv    []string
		env     map[string]string
		ok      bool
		why     string // a piece of the refusal message
	}{
		// No allowlist: anything goes (scopes still apply elsewhere).
		{name: "no allowlist", command: "rm -rf / ; curl x | sh", ok: true},
		{name: "no allowlist, env", command: "x", env: map[string]string{"PATH": "/tmp"}, ok: true},

		// Shell-string form.
		{name: "pytest -q", allow: pytest, command: "pytest -q", ok: true},
		{name: "bare program", allow: pytest, command: "pytest", ok: true},
		{name: "blanks around", allow: pytest, command: " \tpytest  -q\t", ok: true},
		{name: "double-quoted program", allow: pytest, command: `"pytest" -q`, ok: true},
		{name: "quotes joined in a word", allow: pytest, command: `'py''test'`, ok: true},
		{name: "quote inside the word", allow: pytest, command: `py"test" -x`, ok: true},
		{name: "escaped ordinary char", allow: pytest, command: `p\ytest`, ok: true},
		{name: "globs, tilde, = in args", allow: pytest, command: `pytest tests/*.py -k 'a or b' --rootdir=~ x?[ab] {a,b}`, ok: true},
		{name: "metachars inside single quotes", allow: pytest, command: `pytest -k 'a;b|c&d>e<f(g)$h` + "`i`" + `'`, ok: true},
		{name: "metachars inside double quotes", allow: pytest, command: `pytest -k "a;b|c&d>e<f(g)"`, ok: true},
		{name: "escaped space and quotes", allow: pytest, command: `pytest a\ b \' \"`, ok: true},
		{name: "hash inside a word", allow: pytest, command: `pytest a#b`, ok: true},
		{name: "python -c with python", allow: both, command: `python -c "import os"`, ok: true},
		{name: "python -c without python", allow: pytest, command: `python -c "import os"`, why: `"python" is not in`},
		{name: "; rm", allow: pytest, command: "pytest; rm -rf /", why: "';'"},
		{name: "&&", allow: pytest, command: "pytest && rm -rf /", why: "'&'"},
		{name: "||", allow: pytest, command: "pytest || x", why: "'|'"},
		{name: "pipe", allow: pytest, command: "pytest | sh", why: "'|'"},
		{name: "$( )", allow: pytest, command: "pytest $(rm -rf /)", why: "'$'"},
		{name: "backticks", allow: pytest, command: "pytest `id`", why: "'`'"},
		{name: "redirect out", allow: pytest, command: "pytest > /etc/x", why: "'>'"},
		{name: "redirect in", allow: pytest, command: "pytest < /etc/shadow", why: "'<'"},
		{name: "2>&1", allow: pytest, command: "pytest 2>&1", why: "'>'"},
		{name: "newline", allow: pytest, command: "pytest\nrm -rf /", why: "line break"},
		{name: "carriage return", allow: pytest, command: "pytest\rrm -rf /", why: "line break"},
		{name: "background &", allow: pytest, command: "pytest & ", why: "'&'"},
		{name: "subshell", allow: pytest, command: "(pytest)", why: "'('"},
		{name: "assignment prefix", allow: pytest, command: "PATH=/tmp pytest", why: "assignment"},
		{name: "assignment after blanks", allow: pytest, command: "  LD_PRELOAD=/tmp/x.so pytest", why: "assignment"},
		{name: "relative ./pytest", allow: pytest, command: "./pytest", why: `"./pytest" is not in`},
		{name: "other path", allow: pytest, command: "/tmp/pytest -q", why: "not in"},
		{name: "rm", allow: pytest, command: "rm -rf /", why: `"rm" is not in`},
		{name: "$HOME in double quotes", allow: pytest, command: `"$HOME"`, why: "'$' inside double quotes"},
		{name: "backtick in double quotes", allow: pytest, command: "pytest \"`id`\"", why: "inside double quotes"},
		{name: "backslash in double quotes", allow: pytest, command: `pytest "a\"b"`, why: "inside double quotes"},
		{name: "$ alone", allow: pytest, command: "pytest $HOME", why: "'$'"},
		{name: "ANSI-C quote", allow: pytest, command: `pytest $'\x41'`, why: "'$'"},
		{name: "escaped ;", allow: pytest, command: `pytest \; rm`, why: "escapes"},
		{name: "trailing backslash", allow: pytest, command: `pytest \`, why: "backslash"},
		{name: "line continuation", allow: pytest, command: "pytest \\\nrm", why: "line break"},
		{name: "unterminated single quote", allow: pytest, command: `pytest 'x`, why: "unterminated single"},
		{name: "unterminated double quote", allow: pytest, command: `pytest "x`, why: "unterminated double"},
		{name: "empty", allow: pytest, command: "", why: "empty"},
		{name: "blanks only", allow: pytest, command: " \t ", why: "empty"},
		{name: "empty quoted program", allow: pytest, command: `'' pytest`, why: `"" is not in`},
		{name: "NUL", allow: pytest, command: "pytest\x00; rm", why: "NUL"},
		{name: "control character", allow: pytest, command: "pytest \x1b[2J", why: "control"},
		{name: "comment", allow: pytest, command: "pytest #x", why: "comment"},
		{name: "comment first", allow: pytest, command: "#pytest", why: "comment"},
		{name: "negation keyword", allow: pytest, command: "! pytest", why: `"!" is not in`},
		{name: "brace group", allow: pytest, command: "{ pytest; }", why: "';'"},
		{name: "program with a prefix", allow: pytest, command: "pytest3", why: "not in"},
		{name: "process substitution", allow: pytest, command: "pytest <(id)", why: "'<'"},
		{name: "tilde program", allow: pytest, command: "~/pytest", why: "not in"},
		{name: "env set", allow: pytest, command: "pytest", env: map[string]string{"PATH": "/tmp"}, why: "environment"},
		{name: "empty env is fine", allow: pytest, command: "pytest", env: map[string]string{}, ok: true},

		// Argv form.
		{name: "argv allowed", allow: pytest, argv: []string{"pytest", "-q", "; rm -rf /", "$(id)"}, ok: true},
		{name: "argv other program", allow: pytest, argv: []string{"rm", "-rf", "/"}, why: `"rm" is not in`},
		{name: "argv relative", allow: pytest, argv: []string{"./pytest"}, why: "not in"},
		{name: "argv padded", allow: pytest, argv: []string{"pytest "}, why: "not in"},
		{name: "argv quoted program is literal", allow: pytest, argv: []string{`"pytest"`}, why: "not in"},
		{name: "argv empty program", allow: pytest, argv: []string{""}, why: "not in"},
		{name: "argv NUL", allow: pytest, argv: []string{"pytest", "a\x00b"}, why: "NUL"},
		{name: "argv with env", allow: pytest, argv: []string{"pytest"}, env: map[string]string{"LD_PRELOAD": "x"}, why: "environment"},
		{name: "argv absolute entry", allow: []string{"/usr/bin/python3"}, argv: []string{"/usr/bin/python3", "-V"}, ok: true},
		{name: "both forms", allow: pytest, command: "pytest", argv: []string{"pytest"}, why: "not both"},

		// Invalid allowlist entries never match.
		{name: "invalid entry", allow: []string{"py test"}, command: `"py test"`, why: "not in"},
		{name: "builtin entry", allow: []string{"eval"}, command: "eval id", why: "not in"},
		{name: "empty entry", allow: []string{""}, argv: []string{""}, why: "not in"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckCommand(tc.allow, tc.command, tc.argv, tc.env)
			if tc.ok {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if got := code(t, err); got != protocol.CodeCommandNotAllowed {
				t.Fatalf("code %q, want command_not_allowed", got)
			}
			if !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("message %q does not say %q", err.Error(), tc.why)
			}
		})
	}
}

// TestSplitMatchesShell runs allowed commands through a real /bin/sh (and bash) with printf in place
// of the program, and checks the shell sees exactly the words splitSimpleCommand sees. The commands
// are fixed and harmless; nothing fuzzed is ever run.
func TestSplitMatchesShell(t *testing.T) {
	t.Parallel()
	args := []string{
		`-q`,
		`'a b'  "c d"	e`,
		`py'te'"st" x''y "" ''`,
		`a\ b \' \" \\ \a`,
		`'a;b|c&d>e<f(g)$h` + "`i`" + `'`,
		`"a;b|c&d>e<f(g)" 'x"y' "x'y"`,
		`--opt=val a=b a#b`,
		`*.nomatch x?y [ab]c`,
		"tab\there",
		`'é ü' "日本"`,
	}
	dir := t.TempDir() // empty, so unmatched globs stay as they are
	for _, shell := range []string{"/bin/sh", "/bin/bash"} {
		if _, err := os.Stat(shell); err != nil {
			t.Logf("%s not found; skipped", shell)
			continue
		}
		for _, a := range args {
			command := `printf '%s\0' ` + a
			words, why := splitSimpleCommand(command)
			if why != "" {
				t.Fatalf("%q refused: %s", command, why)
			}
			cmd := exec.Command(shell, "-c", command)
			cmd.Dir = dir
			cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + dir}
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("%s -c %q: %v", shell, command, err)
			}
			got := strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00")
			if !slices.Equal(got, words[2:]) {
				t.Errorf("%s: %q: shell words %q, ours %q", shell, a, got, words[2:])
			}
		}
	}
}

// FuzzCheckCommand checks, for any command, that what CheckCommand allows under an allowlist has no
// unquoted metacharacter, no control character, nothing expandable inside double quotes, and starts
// with an allowlisted word after quote removal. The oracle below is written independently of
// splitSimpleCommand.
func FuzzCheckCommand(f *testing.F) {
	for _, s := range []string{
		"pytest -q", "pytest; rm -rf /", "pytest && rm -rf /", "pytest || x", "pytest | sh",
		"pytest $(rm -rf /)", "pytest `id`", "pytest > /etc/x", "pytest < /etc/shadow", "pytest 2>&1",
		"pytest\nrm -rf /", "pytest & ", "(pytest)", "PATH=/tmp pytest", `"pytest" -q`, `'py''test'`,
		"./pytest", "rm -rf /", `python -c "import os"`, `"$HOME"`, `pytest a\ b`, `pytest \;`, `py"test"`,
		`pytest 'a;b'`, `pytest "a\"b"`, `pytest #x`, "pytest\t-q", `python -c 'print(1); import os'`,
	} {
		f.Add(s, "pytest")
	}
	allow := []string{"pytest", "python", "/usr/bin/env"}
	f.Fuzz(func(t *testing.T, command, argv0 string) {
		if err := CheckCommand(allow, command, nil, nil); err != nil {
			if code(t, err) != protocol.CodeCommandNotAllowed {
				t.Fatalf("code %v", err)
			}
		} else {
			first, why := oracleFirstWord(command)
			if why != "" {
				t.Fatalf("allowed %q, but it %s", command, why)
			}
			if !slices.Contains(allow, first) {
				t.Fatalf("allowed %q, whose first word %q is not allowlisted", command, first)
			}
		}
		if err := CheckCommand(allow, "", []string{argv0, command}, nil); err == nil && !slices.Contains(allow, argv0) {
			t.Fatalf("allowed argv[0] %q", argv0)
		}
	})
}

// oracleFirstWord scans a command the way a POSIX shell quotes it and returns its first word after
// quote removal, or what about it should have been refused.
func oracleFirstWord(s string) (first string, why string) {
	const (
		plain = iota
		single
		double
	)
	state := plain
	var word bytes.Buffer
	words := 0
	started := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 && c != '\t' || c == 0x7f {
			return "", "contains a control character"
		}
		switch state {
		case single:
			if c == '\'' {
				state = plain
			} else if words == 0 {
				word.WriteByte(c)
			}
		case double:
			switch c {
			case '"':
				state = plain
			case '$', '`', '\\':
				return "", "has an expansion inside double quotes"
			default:
				if words == 0 {
					word.WriteByte(c)
				}
			}
		case plain:
			switch c {
			case ';', '&', '|', '<', '>', '(', ')', '$', '`':
				return "", "has an unquoted metacharacter"
			case '\'':
				state, started = single, true
			case '"':
				state, started = double, true
			case '\\':
				if i+1 == len(s) || strings.IndexByte(";&|<>()$`", s[i+1]) >= 0 {
					return "", "escapes a metacharacter or ends in a backslash"
				}
				i++
				if words == 0 {
					word.WriteByte(s[i])
				}
				started = true
			case ' ', '\t':
				if started {
					words++
					started = false
				}
			default:
				if c == '#' && !started {
					return "", "has a comment"
				}
				if c == '=' && words == 0 && !strings.ContainsAny(s[:i], `'"\`) && strings.Trim(s[:i], " \t") != "" {
					return "", "starts with an assignment"
				}
				if words == 0 {
					word.WriteByte(c)
				}
				started = true
			}
		}
	}
	if state != plain {
		return "", "has an unterminated quote"
	}
	return word.String(), ""
}

// A bare allowlisted name is found through the sandbox's PATH. An entry the token may write into
// (under /workspace or /proc with fs:write) or one resolved against the working directory (empty,
// ".", relative: the cwd is the token's to choose) lets it plant any program under that name.
func TestCheckSearchPath(t *testing.T) {
	write := []string{protocol.ScopeFSRead, protocol.ScopeFSWrite, protocol.ScopeExec}
	for _, path := range []string{
		"/workspace/.venv/bin:/usr/bin", "/usr/bin:/workspace", "/usr/bin:", ":/usr/bin", "/usr/bin::/bin",
		".:/usr/bin", "bin:/usr/bin", "/usr/../workspace/bin", "//workspace/bin", "/proc/self/cwd", "/dev/fd/3",
		"/dev/fd/../cwd", "/dev/fd/../root/workspace/bin:/usr/bin",
	} {
		err := CheckSearchPath(write, []string{"/usr/bin/true", "pytest"}, path, true)
		if code(t, err) != protocol.CodeInvalidArgument || !strings.Contains(err.Error(), "pytest") || !strings.Contains(err.Error(), "PATH") {
			t.Errorf("PATH %q with fs:write and a bare name: %v, want invalid_argument naming pytest and PATH", path, err)
		}
	}
	for _, tc := range []struct {
		scopes []string
		allow  []string
		path   string
	}{
		{write, []string{"pytest"}, "/usr/local/bin:/usr/bin:/bin"},
		{write, []string{"/usr/bin/pytest"}, "/workspace/bin:/usr/bin"}, // absolute: PATH is not used
		{[]string{protocol.ScopeFSRead, protocol.ScopeExec}, []string{"pytest"}, "/workspace/bin:/usr/bin"},
		{write, nil, "/workspace/bin"}, // no allowlist: every program may run anyway
		{write, []string{"pytest"}, "/workspaces/bin:/opt/workspace/bin"},
	} {
		if err := CheckSearchPath(tc.scopes, tc.allow, tc.path, true); err != nil {
			t.Errorf("%v %v PATH %q: %v, want it allowed", tc.scopes, tc.allow, tc.path, err)
		}
	}
}

// A sandbox whose PATH the broker does not know (a kubernetes template that sets none runs its
// image's) may find a bare name through a directory the token may write: with fs:write the mint
// is refused, saying why and what to do. An absolute path, or a token without fs:write, does not
// depend on PATH.
func TestCheckSearchPathFailsClosedOnAnUnknownPATH(t *testing.T) {
	write := []string{protocol.ScopeFSRead, protocol.ScopeFSWrite, protocol.ScopeExec}
	err := CheckSearchPath(write, []string{"/usr/bin/true", "pytest"}, "/usr/local/bin:/usr/bin:/bin", false)
	if code(t, err) != protocol.CodeInvalidArgument {
		t.Fatalf("fs:write and a bare name under an unknown PATH: %v, want invalid_argument", err)
	}
	for _, want := range []string{"pytest", "PATH", "does not know", "absolute path", "template's env", protocol.ScopeFSWrite} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal %q does not say %q", err, want)
		}
	}
	for _, tc := range []struct {
		scopes []string
		allow  []string
	}{
		{write, []string{"/usr/bin/pytest"}},
		{[]string{protocol.ScopeFSRead, protocol.ScopeExec}, []string{"pytest"}},
		{write, nil},
	} {
		if err := CheckSearchPath(tc.scopes, tc.allow, "", false); err != nil {
			t.Errorf("%v %v under an unknown PATH: %v, want it allowed", tc.scopes, tc.allow, err)
		}
	}
}
