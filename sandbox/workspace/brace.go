package workspace

import (
	"strings"

	"github.com/sbxbroker/broker/protocol"
)

// maxBraceAlternatives bounds how many names one pattern segment's braces expand to, so that a
// pattern like "{a,b}{c,d}{e,f}..." cannot cost unbounded memory or matching time.
const maxBraceAlternatives = 256

// braceGroup finds the first brace group of s that expands: an unescaped '{' outside a bracket
// class, its matching '}', and at least one comma at its own depth. It returns the group's
// bounds and the positions of those commas, or open < 0 when s has none. A group without a comma
// ("{a}") or without its '}' stays literal, as in bash and in deepagents' glob libraries.
func braceGroup(s string) (open, close int, commas []int) {
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '[':
			i = classEnd(s, i)
		case '{':
			if end, cs := braceEnd(s, i); end >= 0 && len(cs) > 0 {
				return i, end, cs
			}
		}
	}
	return -1, -1, nil
}

// classEnd is the index of the ']' closing the bracket class that starts at s[i] (path.Match
// syntax: an optional '^', then at least one character), or i when it does not close.
func classEnd(s string, i int) int {
	j := i + 1
	if j < len(s) && s[j] == '^' {
		j++
	}
	for first := true; j < len(s); j++ {
		switch {
		case s[j] == '\\':
			j++
		case s[j] == ']' && !first:
			return j
		}
		first = false
	}
	return i
}

// braceEnd is the index of the '}' matching the '{' at s[i], with the commas at its depth; -1
// when it does not close.
func braceEnd(s string, i int) (int, []int) {
	depth := 0
	var commas []int
	for j := i; j < len(s); j++ {
		switch s[j] {
		case '\\':
			j++
		case '[':
			j = classEnd(s, j)
		case '{':
			depth++
		case '}':
			if depth--; depth == 0 {
				return j, commas
			}
		case ',':
			if depth == 1 {
				commas = append(commas, j)
			}
		}
	}
	return -1, nil
}

// expandBraces expands the brace groups of a pattern segment ("*.{ts,tsx}" is "*.ts" and
// "*.tsx"; groups nest) into at most maxBraceAlternatives brace-free patterns. ok is false
// when the segment has no group to expand.
func expandBraces(s string) (alts []string, ok bool, err error) {
	if open, _, _ := braceGroup(s); open < 0 {
		return nil, false, nil
	}
	var out []string
	var expand func(string) error
	expand = func(s string) error {
		open, close, commas := braceGroup(s)
		if open < 0 {
			if len(out) == maxBraceAlternatives {
				return protocol.Errorf(protocol.CodeInvalidArgument, "the glob pattern's braces expand to more than %d names; use fewer alternatives", maxBraceAlternatives)
			}
			out = append(out, s)
			return nil
		}
		start := open + 1
		for _, end := range append(commas, close) {
			if err := expand(s[:open] + s[start:end] + s[close+1:]); err != nil {
				return err
			}
			start = end + 1
		}
		return nil
	}
	if err := expand(s); err != nil {
		return nil, false, err
	}
	return out, true, nil
}

// splitSegments splits a pattern at the '/'s outside brace groups. ok is false when a group that
// expands holds a '/': braces choose within one path segment here.
func splitSegments(p string) (segs []string, ok bool) {
	start := 0
	for i := 0; i < len(p); i++ {
		switch p[i] {
		case '\\':
			i++
		case '[':
			i = classEnd(p, i)
		case '{':
			if end, cs := braceEnd(p, i); end >= 0 && len(cs) > 0 {
				if strings.Contains(p[i:end], "/") {
					return nil, false
				}
				i = end
			}
		case '/':
			segs = append(segs, p[start:i])
			start = i + 1
		}
	}
	return append(segs, p[start:]), true
}
