package protocol

import "bytes"

// The canonical envelopes, as the Go and TypeScript clients write requests and the broker writes
// answers, are recognized without a JSON decode: the envelope is split by position and only the
// args (or result) are decoded, once. Anything else (other key order, whitespace, escapes, error
// answers) is not recognized, and the caller decodes it in full. FuzzSplitRequest holds these to
// encoding/json's reading of the same bytes.

// SplitRequest recognizes {"id":N,"op":"name"} and {"id":N,"op":"name","args":VALUE} exactly, with
// N a uint32 in decimal and name lowercase letters and '_'. args is VALUE's bytes, not yet checked
// to be JSON (the caller decodes it strictly).
func SplitRequest(b []byte) (id uint32, op string, args []byte, ok bool) {
	rest, ok := bytes.CutPrefix(b, []byte(`{"id":`))
	if !ok {
		return 0, "", nil, false
	}
	id, rest, ok = cutUint32(rest)
	if !ok {
		return 0, "", nil, false
	}
	if rest, ok = bytes.CutPrefix(rest, []byte(`,"op":"`)); !ok {
		return 0, "", nil, false
	}
	n := 0
	for n < len(rest) && n <= 32 && (rest[n] >= 'a' && rest[n] <= 'z' || rest[n] == '_') {
		n++
	}
	if n == 0 || n > 32 || n >= len(rest) || rest[n] != '"' {
		return 0, "", nil, false
	}
	op, rest = string(rest[:n]), rest[n+1:]
	if len(rest) == 1 && rest[0] == '}' {
		return id, op, nil, true
	}
	if rest, ok = bytes.CutPrefix(rest, []byte(`,"args":`)); !ok || len(rest) < 2 || rest[len(rest)-1] != '}' {
		return 0, "", nil, false
	}
	return id, op, rest[:len(rest)-1], true
}

// SplitResult recognizes {"id":N,"result":VALUE} exactly and returns VALUE's bytes.
func SplitResult(b []byte) (id uint32, result []byte, ok bool) {
	rest, ok := bytes.CutPrefix(b, []byte(`{"id":`))
	if !ok {
		return 0, nil, false
	}
	id, rest, ok = cutUint32(rest)
	if !ok {
		return 0, nil, false
	}
	if rest, ok = bytes.CutPrefix(rest, []byte(`,"result":`)); !ok || len(rest) < 2 || rest[len(rest)-1] != '}' {
		return 0, nil, false
	}
	return id, rest[:len(rest)-1], true
}

// cutUint32 reads a decimal uint32 as JSON writes it (no sign, no leading zeros, no fraction).
func cutUint32(b []byte) (uint32, []byte, bool) {
	var v uint64
	n := 0
	for n < len(b) && b[n] >= '0' && b[n] <= '9' {
		v = v*10 + uint64(b[n]-'0')
		n++
		if n > 10 || v > 1<<32-1 {
			return 0, nil, false
		}
	}
	if n == 0 || (n > 1 && b[0] == '0') || (n < len(b) && (b[n] == '.' || b[n] == 'e' || b[n] == 'E')) {
		return 0, nil, false
	}
	return uint32(v), b[n:], true
}
