package provider

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// DefaultTemplateName is the template that always exists.
const DefaultTemplateName = "default"

// DefaultTemplate is the built-in template: the host's /usr, no network, the broker's default limits.
// A templates file may override it by defining "default".
func DefaultTemplate() Template {
	return Template{Name: DefaultTemplateName}
}

// MarshalJSON writes d as a Go duration string ("30s").
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON reads a Go duration string ("30s", "10m", "1h30m"). Bare numbers are refused: their
// unit would be a guess.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string like \"30s\" or \"10m\", got %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("duration %q: use a form like \"30s\" or \"10m\"", s)
	}
	*d = Duration(v)
	return nil
}

// String is the Go duration form.
func (d Duration) String() string { return time.Duration(d).String() }

// LoadTemplates reads a templates file, YAML or JSON, holding either a list of templates (each with a
// name) or a map from name to template. The result always contains "default" (the built-in one unless
// the file defines it). Every template is validated; an error names the template and the field.
func LoadTemplates(file string) (map[string]Template, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("templates: %w", err)
	}
	js, err := yaml.YAMLToJSONStrict(raw)
	if err != nil {
		return nil, fmt.Errorf("templates %s: %w", file, err)
	}
	js = bytes.TrimSpace(js)
	type entry struct {
		key string // map key, "" for list entries
		pos int
		raw json.RawMessage
	}
	var entries []entry
	switch {
	case len(js) == 0 || string(js) == "null":
		// An empty file defines nothing; the default remains.
	case js[0] == '[':
		var list []json.RawMessage
		if err := json.Unmarshal(js, &list); err != nil {
			return nil, fmt.Errorf("templates %s: %w", file, err)
		}
		for i, r := range list {
			entries = append(entries, entry{pos: i, raw: r})
		}
	case js[0] == '{':
		var m map[string]json.RawMessage
		if err := json.Unmarshal(js, &m); err != nil {
			return nil, fmt.Errorf("templates %s: %w", file, err)
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for i, k := range keys {
			entries = append(entries, entry{key: k, pos: i, raw: m[k]})
		}
	default:
		return nil, fmt.Errorf("templates %s: want a list of templates or a map of name to template", file)
	}

	out := map[string]Template{DefaultTemplateName: DefaultTemplate()}
	defined := map[string]bool{}
	for _, e := range entries {
		label := fmt.Sprintf("template #%d", e.pos+1)
		var named struct {
			Name string `json:"name"`
		}
		if e.key != "" {
			label = fmt.Sprintf("template %q", e.key)
		} else if json.Unmarshal(e.raw, &named) == nil && named.Name != "" {
			label = fmt.Sprintf("template %q", named.Name)
		}
		var t Template
		dec := json.NewDecoder(bytes.NewReader(e.raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&t); err != nil {
			return nil, fmt.Errorf("templates %s: %s: %s", file, label, jsonFieldError(err))
		}
		if e.key != "" {
			if t.Name != "" && t.Name != e.key {
				return nil, fmt.Errorf("templates %s: %s: name %q differs from its key", file, label, t.Name)
			}
			t.Name = e.key
		}
		if t.Name != "" {
			label = fmt.Sprintf("template %q", t.Name)
		}
		if err := t.Validate(); err != nil {
			return nil, fmt.Errorf("templates %s: %s: %w", file, label, err)
		}
		if defined[t.Name] {
			return nil, fmt.Errorf("templates %s: %s is defined twice", file, label)
		}
		defined[t.Name] = true
		out[t.Name] = t
	}
	return out, nil
}

// jsonFieldError turns encoding/json's messages into ones that name the template field.
func jsonFieldError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return fmt.Sprintf("field %s: want %s, got %s", te.Field, te.Type, te.Value)
	}
	msg := err.Error()
	return strings.TrimPrefix(msg, "json: ")
}

// Validate checks a template: a usable name; rootfs and mount sources existing directories; mount
// targets absolute and outside the paths the sandbox provides itself; limits not negative; env names
// valid. Errors name the field.
func (t Template) Validate() error {
	if t.Name == "" {
		return errors.New("name: required")
	}
	for _, r := range t.Name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("name %q: use letters, digits, '-', '_' and '.'", t.Name)
		}
	}
	return t.validateContent()
}

// validateContent is Validate without the name, for Start: a caller may build a template in code.
func (t Template) validateContent() error {
	if t.Rootfs != "" {
		if !filepath.IsAbs(t.Rootfs) {
			return fmt.Errorf("rootfs %q: must be an absolute path", t.Rootfs)
		}
		if err := isDir(t.Rootfs); err != nil {
			return fmt.Errorf("rootfs: %w", err)
		}
	}
	targets := map[string]bool{}
	for i, m := range t.Mounts {
		field := fmt.Sprintf("mounts[%d]", i)
		if m.Source == "" || !filepath.IsAbs(m.Source) {
			return fmt.Errorf("%s.source %q: must be an absolute path", field, m.Source)
		}
		if err := isDir(m.Source); err != nil {
			return fmt.Errorf("%s.source: %w", field, err)
		}
		if m.Target == "" || !path.IsAbs(m.Target) {
			return fmt.Errorf("%s.target %q: must be an absolute path", field, m.Target)
		}
		tgt := path.Clean(m.Target)
		if tgt == "/" {
			return fmt.Errorf("%s.target: cannot be /", field)
		}
		for _, reserved := range []string{WorkspacePath, "/proc", "/dev", sbxDir} {
			if tgt == reserved || strings.HasPrefix(tgt, reserved+"/") {
				return fmt.Errorf("%s.target %q: must not be under %s", field, m.Target, reserved)
			}
		}
		if targets[tgt] {
			return fmt.Errorf("%s.target %q: mounted twice", field, m.Target)
		}
		targets[tgt] = true
	}
	for k, v := range t.Env {
		if !validEnvName(k) {
			return fmt.Errorf("env %q: not a valid variable name", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return fmt.Errorf("env %q: value contains a NUL byte", k)
		}
	}
	if len(t.Network.Allow) > 0 {
		if !t.Network.Enabled {
			return errors.New("network: an allowlist needs the network on")
		}
		if _, err := parseAllow(t.Network.Allow); err != nil {
			return err
		}
	}
	if err := t.Limits.validate(); err != nil {
		return fmt.Errorf("limits: %w", err)
	}
	if t.Disk != 0 && t.Disk < MinDisk {
		return fmt.Errorf("disk %s: must be at least %s", t.Disk, ByteSize(MinDisk))
	}
	switch t.Isolation {
	case "", IsolationNamespace, IsolationGvisor, IsolationMicroVM:
	default:
		return fmt.Errorf("isolation %q: use namespace (the default), gvisor or microvm", t.Isolation)
	}
	if t.Pool.Size < 0 || t.Pool.Size > MaxPoolSize {
		return fmt.Errorf("pool.size %d: must be between 0 and %d", t.Pool.Size, MaxPoolSize)
	}
	if t.Tmp < 0 || t.Tmp != 0 && t.Tmp < 1<<20 {
		return fmt.Errorf("tmp %s: must be at least 1MiB", t.Tmp)
	}
	return nil
}

func isDir(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", p)
	}
	return nil
}
