package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
)

// decodeStrict decodes exactly one JSON value into v, the one way both front ends do (REST bodies,
// the dataplane's requests and args): UTF-8 with no lone surrogate escaped, no unknown field, no
// key given twice or in another case than v's (exactKeys), nothing but space after it.
func decodeStrict(b []byte, v any) error {
	// encoding/json would read such bytes, or such an escape, as U+FFFD: what is kept would not be
	// what was sent.
	if !utf8.Valid(b) {
		return errNotUTF8
	}
	if loneSurrogate(b) {
		return errLoneSurrogate
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if len(bytes.TrimSpace(b[dec.InputOffset():])) != 0 {
		return errTrailingData
	}
	return exactKeys(b, reflect.TypeOf(v))
}

var (
	errNotUTF8       = errors.New("not UTF-8: JSON text must be")
	errLoneSurrogate = errors.New("a lone UTF-16 surrogate is escaped (\\uD800-\\uDFFF not in a pair), which names no character: JSON text must be UTF-8")
	errTrailingData  = errors.New("data after the JSON value")
)

// exactKeys refuses a body that encoding/json decodes into t by guessing: a key repeated in one
// object (it keeps the last), or a field named other than exactly as documented (it matches
// names case-insensitively, with Unicode folding: "ſcopes" is "scopes"). A proxy or policy check in
// front of the broker may read such a body differently (the first "scopes", only the exact name),
// and then checks what the broker does not do. body has decoded into t already.
func exactKeys(body []byte, t reflect.Type) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber() // numbers are skipped, never converted
	return keysOf(dec, t)
}

// keysOf reads one value from dec, checking the keys of its objects as exactKeys says; t is the
// Go type it decodes into, or nil where that is not known (then keys are only checked for repeats).
func keysOf(dec *json.Decoder, t reflect.Type) error {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	tok, err := dec.Token()
	if err != nil {
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body is not valid JSON for this route")
	}
	switch tok {
	case json.Delim('['):
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		for dec.More() {
			if err := keysOf(dec, elem); err != nil {
				return err
			}
		}
		_, err = dec.Token()
	case json.Delim('{'):
		var fields map[string]reflect.Type
		var elem reflect.Type
		switch {
		case t != nil && t.Kind() == reflect.Struct:
			fields = jsonFields(t)
		case t != nil && t.Kind() == reflect.Map:
			elem = t.Elem()
		}
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return protocol.Errorf(protocol.CodeInvalidJSON, "request body is not valid JSON for this route")
			}
			key, _ := kt.(string)
			seenAs := key
			if fields != nil {
				ft, ok := fields[key]
				if !ok {
					return protocol.Errorf(protocol.CodeInvalidJSON, "field %q is not one of this route's: field names are case-sensitive (see docs/openapi.yaml)", clipField(key))
				}
				elem, seenAs = ft, foldName(key)
			}
			if seen[seenAs] {
				return protocol.Errorf(protocol.CodeInvalidJSON, "key %q is given twice in one object; give it once", clipField(key))
			}
			seen[seenAs] = true
			if err := keysOf(dec, elem); err != nil {
				return err
			}
		}
		_, err = dec.Token()
	}
	if err != nil {
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body is not valid JSON for this route")
	}
	return nil
}

// jsonFields maps each JSON name of struct t's fields (as encoding/json names them) to its type.
// Request bodies are flat structs: embedded structs are not followed.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

// foldName folds a key as encoding/json does to match it to a field, so that keys it would take as
// one field count as a repeat.
func foldName(s string) string {
	var b strings.Builder
	for _, r := range s {
		b.WriteRune(unicode.ToUpper(unicode.ToLower(r)))
	}
	return b.String()
}

// clipField bounds a caller's key quoted back in a message.
func clipField(s string) string {
	const most = 64
	if len(s) > most {
		cut := most
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "..."
	}
	return strings.ToValidUTF8(s, "?")
}

// loneSurrogate reports whether body escapes a UTF-16 surrogate that is not the first half of a
// pair followed by its second: encoding/json reads one as U+FFFD, as it does bytes that are not
// UTF-8, so what the broker keeps would not be what was sent. A backslash appears only inside a
// string of valid JSON, where it starts an escape of two bytes or, for \u, of six.
func loneSurrogate(body []byte) bool {
	hex4 := func(i int) (rune, bool) {
		if i+6 > len(body) || body[i] != '\\' || body[i+1] != 'u' {
			return 0, false
		}
		var r rune
		for _, c := range body[i+2 : i+6] {
			switch {
			case '0' <= c && c <= '9':
				r = r<<4 | rune(c-'0')
			case 'a' <= c && c <= 'f':
				r = r<<4 | rune(c-'a'+10)
			case 'A' <= c && c <= 'F':
				r = r<<4 | rune(c-'A'+10)
			default:
				return 0, false
			}
		}
		return r, true
	}
	for i := 0; i < len(body); i++ {
		if body[i] != '\\' {
			continue
		}
		r, ok := hex4(i)
		if !ok {
			i++ // a two-byte escape: its second byte may be a backslash
			continue
		}
		i += 5
		switch {
		case 0xDC00 <= r && r <= 0xDFFF:
			return true // a second half with no first
		case 0xD800 <= r && r <= 0xDBFF:
			lo, ok := hex4(i + 1)
			if !ok || lo < 0xDC00 || lo > 0xDFFF {
				return true
			}
			i += 6
		}
	}
	return false
}
