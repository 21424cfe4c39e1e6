package delegation

import (
	"path"
	"slices"
	"strings"

	"github.com/sbxbroker/broker/protocol"
)

// CheckCommand decides whether an exec request may run under a token's command allowlist (its cmd
// claim). It returns nil, or a *protocol.Error with code command_not_allowed whose message says why.
//
// An empty allowlist allows everything. Under an allowlist:
//   - a request that sets env is refused (env could redirect PATH or LD_PRELOAD);
//   - argv form (argv non-empty, command empty): argv[0] must equal an allowlisted entry exactly;
//   - shell-string form (command non-empty, argv empty): command must be a simple command, i.e.
//     words separated by spaces or tabs, made of plain characters, backslash escapes of plain
//     characters, '...' (literal) and "..." (in which $, ` and \ are refused). Anything a shell would
//     treat as an operator, substitution, redirection, comment or assignment (; & | < > ( ) $ `
//     newline, a word starting with #, a leading NAME=value), any control character, and unterminated
//     quotes are refused. Its first word after quote removal must equal an allowlisted entry exactly,
//     so a quoted "pytest", or py'test' (quotes joining within one word, as the shell does), runs
//     pytest, and ./pytest or /tmp/pytest do not match pytest.
//     Glob characters, ~, = and braces in later words are allowed: they only ever make arguments.
//
// An allowlisted interpreter or launcher (sh, python, env, xargs, find, make, pytest with a writable
// conftest.py ...) can still run anything: the allowlist narrows what a token runs directly, it does
// not sandbox what that program does. The guarantee holds for POSIX shells (sh, dash, bash, ash)
// started non-interactively, which is how the dataplane runs a shell-string command.
func CheckCommand(allow []string, command string, argv []string, env map[string]string) error {
	if len(allow) == 0 {
		return nil
	}
	if len(env) > 0 {
		return notAllowed("a token with a command allowlist may not set environment variables (they could redirect PATH or LD_PRELOAD)")
	}
	var program string
	switch {
	case command != "" && len(argv) > 0:
		return notAllowed("give either a shell command or argv, not both")
	case len(argv) > 0:
		for _, a := range argv {
			if strings.IndexByte(a, 0) >= 0 {
				return notAllowed("an argument contains a NUL byte")
			}
		}
		program = argv[0]
	default:
		words, why := splitSimpleCommand(command)
		if why != "" {
			return notAllowed(why + "; under a command allowlist only a simple command may run")
		}
		program = words[0]
	}
	for _, a := range allow {
		// An entry that is not valid never matches (the verifier refuses such tokens anyway).
		if a == program && checkCmdEntry(a) == "" {
			return nil
		}
	}
	return notAllowed(quoteShort(program) + " is not in the token's command allowlist (" + strings.Join(allow, ", ") + ")")
}

// CheckSearchPath decides whether a token of scopes may be minted with allowlist allow for a sandbox
// whose commands find bare program names through searchPath (its PATH). With fs:write, a bare name
// found through a directory the token may write (under the workspace, or /proc, which reaches it),
// or through an entry resolved against the working directory (empty, ".", relative: the token
// chooses the cwd), names whatever program the token plants there, so the allowlist would allow
// every program. A searchPath the broker does not know (known false: a kubernetes sandbox runs its
// image's PATH) may hold such an entry, so a bare name is refused under it. It returns nil, or a
// *protocol.Error with code invalid_argument saying which entry, or that PATH is unknown, and what
// to do.
func CheckSearchPath(scopes, allow []string, searchPath string, known bool) error {
	if !slices.Contains(scopes, protocol.ScopeFSWrite) {
		return nil
	}
	for _, p := range allow {
		if strings.Contains(p, "/") || checkCmdEntry(p) != "" {
			continue // an absolute path (PATH is not searched), or an entry Mint refuses for itself
		}
		if !known {
			return protocol.Errorf(protocol.CodeInvalidArgument,
				"allow_cmd: %s is looked up through the sandbox's PATH, which the broker does not know (its template sets no PATH, so the sandbox runs its image's, and no running sandbox here tells it): that PATH may name a directory this token may write into (scope %s), where it could put any program under that name. Name the program by its absolute path outside the workspace (e.g. /usr/bin/%s), set PATH in the template's env, mint while the sandbox runs, or mint the token without %s",
				quoteShort(p), protocol.ScopeFSWrite, p, protocol.ScopeFSWrite)
		}
		for _, dir := range strings.Split(searchPath, ":") {
			if why := writableDir(dir); why != "" {
				return protocol.Errorf(protocol.CodeInvalidArgument,
					"allow_cmd: %s is looked up through the sandbox's PATH, whose entry %s %s, which this token may write into (scope %s): it could put any program there under that name. Name the program by its absolute path outside the workspace (e.g. /usr/bin/%s), mint the token without %s, or take that entry out of the template's PATH",
					quoteShort(p), quoteShort(dir), why, protocol.ScopeFSWrite, p, protocol.ScopeFSWrite)
			}
		}
	}
	return nil
}

// writableDir says how a directory (a PATH entry, an allowlisted program's) lets a token with
// fs:write place programs in it, or "". /proc reaches the workspace (/proc/self/cwd,
// /proc/self/root/workspace), and so does /dev/fd, which is /proc/self/fd in every sandbox: a
// directory descriptor the program's exec inherits (the kubernetes agent holds one on /workspace).
func writableDir(dir string) string {
	if !strings.HasPrefix(dir, "/") {
		return "is resolved against the working directory"
	}
	// path.Clean takes ".." lexically; the kernel takes it after the symbolic link before it, so
	// /dev/fd/../cwd is /proc/self/cwd, the workspace, while Clean says /dev/cwd.
	if slices.Contains(strings.Split(dir, "/"), "..") {
		return "has a \"..\", which the kernel takes after following the link before it (/dev/fd/.. is /proc/self, which reaches " + protocol.WorkspaceRoot + ")"
	}
	clean := path.Clean(dir)
	for _, root := range []string{protocol.WorkspaceRoot, "/proc", "/dev/fd"} {
		if clean == root || strings.HasPrefix(clean, root+"/") {
			return "is in " + root
		}
	}
	return ""
}

func notAllowed(msg string) *protocol.Error {
	return &protocol.Error{Code: protocol.CodeCommandNotAllowed, Message: msg}
}

// splitSimpleCommand splits a shell command into its words after quote removal, or returns why it is
// not a simple command.
func splitSimpleCommand(s string) (words []string, why string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 && c != '\t' || c == 0x7f {
			switch c {
			case '\n', '\r':
				return nil, "the command contains a line break, which separates commands"
			case 0:
				return nil, "the command contains a NUL byte"
			}
			return nil, "the command contains a control character"
		}
	}
	if isAssignment(strings.TrimLeft(s, " \t")) {
		return nil, "the command starts with a variable assignment (NAME=value)"
	}

	var cur []byte
	inWord := false
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, string(cur))
				cur, inWord = cur[:0], false
			}
			i++
		case c == '\'':
			end := strings.IndexByte(s[i+1:], '\'')
			if end < 0 {
				return nil, "the command has an unterminated single quote"
			}
			cur, inWord = append(cur, s[i+1:i+1+end]...), true
			i += end + 2
		case c == '"':
			j := i + 1
			for ; j < len(s) && s[j] != '"'; j++ {
				if d := s[j]; d == '$' || d == '`' || d == '\\' {
					return nil, "the command has " + quoteByte(d) + " inside double quotes, where the shell expands it"
				}
			}
			if j == len(s) {
				return nil, "the command has an unterminated double quote"
			}
			cur, inWord = append(cur, s[i+1:j]...), true
			i = j + 1
		case c == '\\':
			if i+1 == len(s) {
				return nil, "the command ends with a backslash"
			}
			if d := s[i+1]; isShellMeta(d) {
				return nil, "the command escapes " + quoteByte(d) + "; quote it instead"
			}
			cur, inWord = append(cur, s[i+1]), true
			i += 2
		case isShellMeta(c):
			return nil, "the command contains " + quoteByte(c) + ", a shell operator, substitution or redirection"
		case c == '#' && !inWord:
			return nil, "the command contains a comment (#)"
		default:
			cur, inWord = append(cur, c), true
			i++
		}
	}
	if inWord {
		words = append(words, string(cur))
	}
	if len(words) == 0 {
		return nil, "the command is empty"
	}
	return words, ""
}

// isShellMeta reports the characters that end a simple command or start a substitution or
// redirection when unquoted.
func isShellMeta(c byte) bool {
	switch c {
	case ';', '&', '|', '<', '>', '(', ')', '$', '`':
		return true
	}
	return false
}

// isAssignment reports whether s starts with NAME=, which a shell takes as an assignment.
func isAssignment(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '=':
			return i > 0
		case c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9':
		default:
			return false
		}
	}
	return false
}

func quoteByte(c byte) string {
	if c == '\'' {
		return `"'"`
	}
	return "'" + string(c) + "'"
}
