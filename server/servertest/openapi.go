package servertest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"

	"sigs.k8s.io/yaml"
)

// Spec is docs/openapi.yaml, loaded for checking the server against it. It understands the subset of
// OpenAPI 3 / JSON Schema the spec uses: $ref, type, nullable, required, properties,
// additionalProperties, items, enum, pattern.
type Spec struct {
	doc   map[string]any
	paths []specPath
}

type specPath struct {
	template string
	re       *regexp.Regexp
	item     map[string]any
}

var (
	specOnce sync.Once
	spec     *Spec
	specErr  error
)

// LoadSpec reads docs/openapi.yaml from the module root.
func LoadSpec() (*Spec, error) {
	specOnce.Do(func() {
		dir, _ := os.Getwd()
		for ; dir != "/"; dir = filepath.Dir(dir) {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				break
			}
		}
		raw, err := os.ReadFile(filepath.Join(dir, "docs", "openapi.yaml"))
		if err != nil {
			specErr = err
			return
		}
		s := &Spec{}
		if specErr = yaml.Unmarshal(raw, &s.doc); specErr != nil {
			return
		}
		for tmpl, item := range s.doc["paths"].(map[string]any) {
			s.paths = append(s.paths, specPath{template: tmpl, re: regexp.MustCompile(pathRE(tmpl)), item: item.(map[string]any)})
		}
		// Literal paths win over templated ones (/v1/sandboxes before /v1/sandboxes/{ref}).
		sort.Slice(s.paths, func(i, j int) bool {
			return strings.Count(s.paths[i].template, "{") < strings.Count(s.paths[j].template, "{")
		})
		spec = s
	})
	return spec, specErr
}

func pathRE(tmpl string) string {
	var b strings.Builder
	b.WriteString("^")
	for _, part := range strings.Split(tmpl, "/") {
		if part == "" {
			continue
		}
		b.WriteString("/")
		if strings.HasPrefix(part, "{") {
			b.WriteString("[^/]+")
		} else {
			b.WriteString(regexp.QuoteMeta(part))
		}
	}
	b.WriteString("$")
	return b.String()
}

// Operations lists "METHOD /path/{param}" for every operation in the spec, with the HEAD the
// spec's preamble promises beside every GET not marked x-no-head.
func (s *Spec) Operations() []string {
	var out []string
	for _, p := range s.paths {
		for m, op := range p.item {
			if m == "parameters" {
				continue
			}
			out = append(out, strings.ToUpper(m)+" "+p.template)
			if op, _ := op.(map[string]any); m == "get" && op["x-no-head"] != true {
				out = append(out, "HEAD "+p.template)
			}
		}
	}
	sort.Strings(out)
	return out
}

// ErrorCodes lists the error codes the spec documents (the ErrorCode schema's enum).
func (s *Spec) ErrorCodes() []string {
	var out []string
	for _, c := range asList(s.path("components", "schemas", "ErrorCode")["enum"]) {
		out = append(out, fmt.Sprint(c))
	}
	sort.Strings(out)
	return out
}

// path walks the spec's nested maps by key.
func (s *Spec) path(keys ...string) map[string]any {
	m := s.doc
	for _, k := range keys {
		m, _ = m[k].(map[string]any)
	}
	return m
}

// CheckResponse validates one response against the spec: the route, method and status must be
// documented, and a JSON body must match the documented schema. A HEAD is held to its GET's
// statuses, with no body.
func (s *Spec) CheckResponse(method, path string, status int, contentType string, body []byte) error {
	var item map[string]any
	for _, p := range s.paths {
		if p.re.MatchString(path) {
			item = p.item
			break
		}
	}
	if item == nil {
		return fmt.Errorf("%s %s: path not in docs/openapi.yaml", method, path)
	}
	head := method == http.MethodHead
	if head {
		method = http.MethodGet
	}
	op, ok := item[strings.ToLower(method)].(map[string]any)
	if head && ok && op["x-no-head"] == true {
		op, ok = nil, false
	}
	if !ok {
		if status == 405 {
			return nil
		}
		return fmt.Errorf("%s %s: method not in docs/openapi.yaml", method, path)
	}
	responses, _ := op["responses"].(map[string]any)
	resp, ok := responses[strconv.Itoa(status)]
	if !ok {
		return fmt.Errorf("%s %s: status %d not documented", method, path, status)
	}
	if head {
		if len(body) > 0 {
			return fmt.Errorf("HEAD %s %d: a body of %d bytes", path, status, len(body))
		}
		return nil
	}
	r := s.resolve(resp)
	content, _ := r["content"].(map[string]any)
	if !strings.HasPrefix(contentType, "application/json") || content == nil {
		return nil
	}
	media, _ := content["application/json"].(map[string]any)
	if media == nil {
		return fmt.Errorf("%s %s %d: JSON answer where the spec documents none", method, path, status)
	}
	var v any
	if err := json.Unmarshal(body, &v); err != nil {
		return fmt.Errorf("%s %s %d: body is not JSON: %v", method, path, status, err)
	}
	if err := s.validate(media["schema"], v, "body"); err != nil {
		return fmt.Errorf("%s %s %d: %v", method, path, status, err)
	}
	return nil
}

func (s *Spec) resolve(node any) map[string]any {
	m, _ := node.(map[string]any)
	for m != nil {
		ref, ok := m["$ref"].(string)
		if !ok {
			return m
		}
		var cur any = s.doc
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			cur = cur.(map[string]any)[part]
		}
		m, _ = cur.(map[string]any)
	}
	return m
}

func (s *Spec) validate(schemaNode, v any, at string) error {
	sc := s.resolve(schemaNode)
	if sc == nil {
		return nil
	}
	if v == nil {
		if sc["nullable"] == true {
			return nil
		}
		return fmt.Errorf("%s is null", at)
	}
	if enum, ok := sc["enum"].([]any); ok {
		found := false
		for _, e := range enum {
			if fmt.Sprint(e) == fmt.Sprint(v) {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("%s = %v is not one of %v", at, v, enum)
		}
	}
	switch sc["type"] {
	case "object":
		obj, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("%s is not an object", at)
		}
		for _, r := range asList(sc["required"]) {
			if _, ok := obj[r.(string)]; !ok {
				return fmt.Errorf("%s lacks required %q", at, r)
			}
		}
		props, _ := sc["properties"].(map[string]any)
		for k, val := range obj {
			if p, ok := props[k]; ok {
				if err := s.validate(p, val, at+"."+k); err != nil {
					return err
				}
				continue
			}
			switch ap := sc["additionalProperties"].(type) {
			case bool:
				if !ap {
					return fmt.Errorf("%s has undocumented %q", at, k)
				}
			case map[string]any:
				if err := s.validate(ap, val, at+"."+k); err != nil {
					return err
				}
			default:
				if props != nil {
					return fmt.Errorf("%s has undocumented %q", at, k)
				}
			}
		}
	case "array":
		arr, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%s is not an array", at)
		}
		for i, e := range arr {
			if err := s.validate(sc["items"], e, fmt.Sprintf("%s[%d]", at, i)); err != nil {
				return err
			}
		}
	case "string":
		str, ok := v.(string)
		if !ok {
			return fmt.Errorf("%s is not a string", at)
		}
		if p, ok := sc["pattern"].(string); ok && !regexp.MustCompile(p).MatchString(str) {
			return fmt.Errorf("%s = %q does not match %s", at, str, p)
		}
	case "integer":
		if f, ok := v.(float64); !ok || f != float64(int64(f)) {
			return fmt.Errorf("%s is not an integer", at)
		}
	case "number":
		if _, ok := v.(float64); !ok {
			return fmt.Errorf("%s is not a number", at)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			return fmt.Errorf("%s is not a boolean", at)
		}
	}
	return nil
}

func asList(v any) []any { l, _ := v.([]any); return l }

// checkingTransport validates every response against the spec and fails the test on a mismatch.
type checkingTransport struct {
	t    interface{ Errorf(string, ...any) }
	spec *Spec
	next http.RoundTripper
}

func (c *checkingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := c.next.RoundTrip(req)
	if err != nil || strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return resp, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	if err := c.spec.CheckResponse(req.Method, req.URL.Path, resp.StatusCode, resp.Header.Get("Content-Type"), body); err != nil {
		c.t.Errorf("response does not match docs/openapi.yaml: %v", err)
	}
	return resp, nil
}
