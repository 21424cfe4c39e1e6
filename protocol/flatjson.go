package protocol

import (
	"slices"
	"unicode/utf8"
)

// DecodeFlat decodes the flat objects on the dataplane's hot paths (the args of write, read, edit,
// exec and the file ops; read, write, file and exec results) without encoding/json, which scans
// every byte of a string about four times at ~5 ns each: a 4 KiB file body cost ~50 µs to decode,
// and exec's args, through a strict json.Decoder and reflection, 20-30 µs of each exec's path.
//
// It takes only input whose meaning is certain: one object of the type's known lowercase keys,
// with strings (escapes \" \\ \/ \b \f \n \r \t, no \u), integers, booleans and arrays of strings
// (exec's argv). It answers false for anything else (other key spellings, \u escapes, null, other
// nested values such as exec's env, malformed JSON), and the
// caller then decodes with encoding/json, which decides. FuzzDecodeFlat holds the two to the same
// result for every input DecodeFlat accepts.
func DecodeFlat(b []byte, v any) bool {
	switch t := v.(type) {
	case *WriteArgs:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "content":
				return p.str(&t.Content)
			case "encoding":
				return p.str(&t.Encoding)
			case "mode":
				return p.str(&t.Mode)
			}
			return false
		})
	case *ReadArgs:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "offset":
				return p.int64(&t.Offset)
			case "length":
				return p.int64(&t.Length)
			case "line_offset":
				return p.int(&t.LineOffset)
			case "line_limit":
				return p.int(&t.LineLimit)
			}
			return false
		})
	case *WriteHead:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "mode":
				return p.str(&t.Mode)
			}
			return false
		})
	case *ReadHead:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "size":
				return p.int64(&t.Size)
			case "total_lines":
				return p.int(&t.TotalLines)
			case "total_lines_partial":
				return p.bool(&t.TotalLinesPartial)
			case "truncated":
				return p.bool(&t.Truncated)
			}
			return false
		})
	case *EditArgs:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "old":
				return p.str(&t.Old)
			case "new":
				return p.str(&t.New)
			case "replace_all":
				return p.bool(&t.ReplaceAll)
			}
			return false
		})
	case *StatArgs:
		return flatObject(b, func(k string, p *flatParser) bool { return k == "path" && p.str(&t.Path) })
	case *LsArgs:
		return flatObject(b, func(k string, p *flatParser) bool { return k == "path" && p.str(&t.Path) })
	case *ReadResult:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "content":
				return p.str(&t.Content)
			case "encoding":
				return p.str(&t.Encoding)
			case "size":
				return p.int64(&t.Size)
			case "total_lines":
				return p.int(&t.TotalLines)
			case "total_lines_partial":
				return p.bool(&t.TotalLinesPartial)
			case "truncated":
				return p.bool(&t.Truncated)
			}
			return false
		})
	case *WriteResult:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "size":
				return p.int64(&t.Size)
			case "created":
				return p.bool(&t.Created)
			}
			return false
		})
	case *ExecArgs:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "command":
				return p.str(&t.Command)
			case "argv":
				return p.strs(&t.Argv)
			case "cwd":
				return p.str(&t.Cwd)
			case "stdin":
				return p.str(&t.Stdin)
			case "timeout_ms":
				return p.int64(&t.TimeoutMS)
			case "stream":
				return p.bool(&t.Stream)
			case "combined":
				return p.bool(&t.Combined)
			case "max_output":
				return p.int64(&t.MaxOutput)
			case "background":
				return p.bool(&t.Background)
			}
			return false // env, a map, goes through encoding/json
		})
	case *ExecResult:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "exit_code":
				return p.int(&t.ExitCode)
			case "signal":
				return p.str(&t.Signal)
			case "reason":
				return p.str(&t.Reason)
			case "truncated":
				return p.bool(&t.Truncated)
			case "duration_ms":
				return p.int64(&t.DurationMS)
			case "pid":
				return p.int(&t.Pid)
			case "output":
				return p.strPtr(&t.Output)
			case "stdout":
				return p.strPtr(&t.Stdout)
			case "stderr":
				return p.strPtr(&t.Stderr)
			}
			return false
		})
	case *EditResult:
		return flatObject(b, func(k string, p *flatParser) bool {
			switch k {
			case "path":
				return p.str(&t.Path)
			case "occurrences":
				return p.int(&t.Occurrences)
			}
			return false
		})
	}
	return false
}

// plain marks the bytes a string holds as they are: printable ASCII but the quote and the backslash.
var plain = func() (t [256]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// flatParser walks one JSON text.
type flatParser struct {
	b []byte
	i int
}

func (p *flatParser) space() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *flatParser) byte(c byte) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// flatObject walks {"key": value, ...} calling field for each key; field reads the value or
// answers false. The whole input must be the one object.
func flatObject(b []byte, field func(key string, p *flatParser) bool) bool {
	p := &flatParser{b: b}
	if !p.byte('{') {
		return false
	}
	if p.byte('}') {
		p.space()
		return p.i == len(b)
	}
	// A key given twice has no certain meaning (encoding/json keeps the last, a reader in front
	// may keep the first): such input goes to the strict decoder, which refuses it.
	var seen [8]string
	n := 0
	for {
		var key string
		if !p.str(&key) || !p.byte(':') {
			return false
		}
		if slices.Contains(seen[:n], key) || n == len(seen) {
			return false
		}
		seen[n], n = key, n+1
		p.space()
		if !field(key, p) {
			return false
		}
		if p.byte(',') {
			continue
		}
		if !p.byte('}') {
			return false
		}
		p.space()
		return p.i == len(b)
	}
}

// str reads a string value.
func (p *flatParser) str(dst *string) bool {
	p.space()
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return false
	}
	p.i++
	start := p.i
	// The common case: no escapes. The loop stops at the closing quote, an escape, or a byte that
	// JSON forbids raw in a string (or that needs a UTF-8 check).
	for p.i < len(p.b) && plain[p.b[p.i]] {
		p.i++
	}
	if p.i < len(p.b) && p.b[p.i] == '"' {
		*dst = string(p.b[start:p.i])
		p.i++
		return true
	}
	buf := append([]byte(nil), p.b[start:p.i]...)
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			*dst = string(buf)
			p.i++
			return true
		case c < 0x20:
			return false
		case c >= utf8.RuneSelf:
			r, n := utf8.DecodeRune(p.b[p.i:])
			if r == utf8.RuneError && n == 1 {
				return false // encoding/json would substitute U+FFFD: let it
			}
			buf = append(buf, p.b[p.i:p.i+n]...)
			p.i += n
		case c == '\\':
			if p.i+1 >= len(p.b) {
				return false
			}
			var out byte
			switch p.b[p.i+1] {
			case '"', '\\', '/':
				out = p.b[p.i+1]
			case 'b':
				out = '\b'
			case 'f':
				out = '\f'
			case 'n':
				out = '\n'
			case 'r':
				out = '\r'
			case 't':
				out = '\t'
			default:
				return false // \u and anything else: encoding/json decides
			}
			buf = append(buf, out)
			p.i += 2
		default:
			buf = append(buf, c)
			p.i++
		}
	}
	return false
}

// strPtr reads a string value into a new string (null is encoding/json's to decide).
func (p *flatParser) strPtr(dst **string) bool {
	var s string
	if !p.str(&s) {
		return false
	}
	*dst = &s
	return true
}

// strs reads an array of strings; an empty one is an empty slice, not nil, as encoding/json has it.
func (p *flatParser) strs(dst *[]string) bool {
	if !p.byte('[') {
		return false
	}
	out := []string{}
	if p.byte(']') {
		*dst = out
		return true
	}
	for {
		var s string
		if !p.str(&s) {
			return false
		}
		out = append(out, s)
		if p.byte(',') {
			continue
		}
		if !p.byte(']') {
			return false
		}
		*dst = out
		return true
	}
}

// int64 reads an integer: an optional minus, digits without a leading zero, nothing else.
func (p *flatParser) int64(dst *int64) bool {
	p.space()
	neg := p.i < len(p.b) && p.b[p.i] == '-'
	if neg {
		p.i++
	}
	start := p.i
	var v uint64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		if p.i-start >= 18 { // beyond what surely fits: let encoding/json judge the range
			return false
		}
		v = v*10 + uint64(p.b[p.i]-'0')
		p.i++
	}
	n := p.i - start
	if n == 0 || (n > 1 && p.b[start] == '0') {
		return false
	}
	if p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return false
	}
	if neg {
		*dst = -int64(v)
	} else {
		*dst = int64(v)
	}
	return true
}

func (p *flatParser) int(dst *int) bool {
	var v int64
	if !p.int64(&v) {
		return false
	}
	*dst = int(v)
	return true
}

func (p *flatParser) bool(dst *bool) bool {
	p.space()
	switch {
	case len(p.b)-p.i >= 4 && string(p.b[p.i:p.i+4]) == "true":
		*dst, p.i = true, p.i+4
		return true
	case len(p.b)-p.i >= 5 && string(p.b[p.i:p.i+5]) == "false":
		*dst, p.i = false, p.i+5
		return true
	}
	return false
}
