package main

import (
	"bytes"
	"net"
	"strings"
	"testing"
)

// A second broker on a port that is taken says so and what to do, instead of bind's words alone.
func TestListenTakenSaysWhatToDo(t *testing.T) {
	t.Setenv("HOME", t.TempDir()) // no sbctl config is written anyway: the broker never serves
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	var out, errb bytes.Buffer
	code := run([]string{"--listen", taken.Addr().String(), "--data-dir", providerDataDir(t, "dir"), "--provider", "dir", "--allow-unisolated"}, &out, &errb)
	if code != 1 || !strings.Contains(errb.String(), "another process listens on "+taken.Addr().String()) || !strings.Contains(errb.String(), "--listen") {
		t.Fatalf("exit %d %q; want 1 saying the address is taken and to pick another with --listen", code, errb.String())
	}
}
