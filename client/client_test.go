package client

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// A broker URL's password never reaches an error message, whatever goes wrong.
func TestErrorsRedactTheBrokerPassword(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pw"
	if _, err := New("ftp://u:"+secret+"@host", "k"); err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("not an http URL: %v", err)
	}
	if _, err := New("http://u:"+secret+"@host:bad port", "k"); err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("unparsable URL: %v", err)
	}

	c, err := New("http://u:"+secret+"@127.0.0.1:1", "k")
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.ListSandboxes(t.Context(), ListOptions{})
	var un *UnreachableError
	if !errors.As(err, &un) || strings.Contains(err.Error(), secret) || !strings.Contains(err.Error(), "u:xxxxx@127.0.0.1:1") {
		t.Errorf("unreachable: %v", err)
	}

	html := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "<html>not a broker</html>", http.StatusBadGateway)
	}))
	defer html.Close()
	c, _ = New(strings.Replace(html.URL, "http://", "http://u:"+secret+"@", 1), "k")
	if _, err := c.GetSandbox(context.Background(), "x"); err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("non-API answer: %v", err)
	}
	if u := c.DataplaneURL("x"); strings.Contains(u, secret) || strings.Contains(u, "@") {
		t.Errorf("dataplane URL carries the user: %s", u)
	}
}
