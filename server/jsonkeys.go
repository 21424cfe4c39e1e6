package server

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
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
