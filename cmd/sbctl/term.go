package main

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"unicode"
	"unicode/utf8"
)

// termSafe is the one escaping of every string a human printer shows (-o table, events lines,
// errors, status lines): what a terminal would act on instead of showing becomes a visible Go-style
// escape. Paths, commands and reasons come from delegates and sandboxes, which are untrusted: raw,
// an ESC sequence sets the window title or writes the clipboard (OSC 0, OSC 52), a CR or newline
// forges a line ("pytest -> exit 0"), a bidi override reverses what follows. Escaped are C0 controls
// (tab and newline included), DEL, C1 controls, bidi controls, the Unicode line and paragraph
// separators, and bytes that are not UTF-8. JSON and YAML output is never passed through it: it
// stays exact. Its escapes are plain ASCII, so escaping twice changes nothing.
func termSafe(s string) string { return escapeControls(s, false) }

// termSafeText is termSafe for a block a printer laid out itself: its own newlines and tabs stay.
// Fields inside it must have gone through termSafe, so that theirs do not.
func termSafeText(s string) string { return escapeControls(s, true) }

func escapeControls(s string, keepLayout bool) string {
	i := 0
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if needsEscape(r, size, keepLayout) {
			break
		}
		i += size
	}
	if i == len(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	b.WriteString(s[:i])
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if !needsEscape(r, size, keepLayout) {
			b.WriteString(s[i : i+size])
			i += size
			continue
		}
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x80:
			fmt.Fprintf(&b, `\x%02x`, r)
		default:
			fmt.Fprintf(&b, `\u%04x`, r)
		}
		i += size
	}
	return b.String()
}

func needsEscape(r rune, size int, keepLayout bool) bool {
	switch {
	case r == utf8.RuneError && size == 1:
		return true
	case keepLayout && (r == '\n' || r == '\t'):
		return false
	case r < 0x20 || r == 0x7f || (r >= 0x80 && r <= 0x9f):
		return true
	case r == '\u2028' || r == '\u2029':
		return true
	}
	return r > 0x7f && unicode.Is(unicode.Bidi_Control, r)
}

// safeTable runs a table printer into a buffer and writes it with termSafeText: a guard under the
// printers' own termSafe of each field, so that a field one of them forgets can at worst break the
// table's layout, never reach the terminal raw.
func safeTable(w io.Writer, table func(w io.Writer)) {
	var buf bytes.Buffer
	table(&buf)
	io.WriteString(w, termSafeText(buf.String()))
}

// termWriter applies termSafeText to each write, for output that is streamed (events) rather than
// printed at once. Its writers (a tabwriter's lines) write whole lines, so no rune is split.
type termWriter struct{ w io.Writer }

func (t termWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(t.w, termSafeText(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}
