package client_test

import (
	"bytes"
	"testing"

	"github.com/sbxbroker/broker/backend"
	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/server/servertest"
)

// An owner talking to a broker that does not host its sandbox reaches the sandbox's dataplane all
// the same: the view names the hosting broker's, which is what sbctl exec dials.
func TestDataplaneThroughAnotherBroker(t *testing.T) {
	t.Parallel()
	a := servertest.New(t, servertest.Options{Node: "node-a"})
	b := servertest.New(t, servertest.Options{Node: "node-b", Redis: a.Redis})
	viaB := b.NewClient(a.Org)
	ctx := t.Context()
	if _, err := a.Client.CreateSandbox(ctx, protocol.CreateSandboxRequest{Name: "dev"}); err != nil {
		t.Fatal(err)
	}
	url, err := viaB.SandboxDataplaneURL(ctx, "dev")
	if err != nil {
		t.Fatal(err)
	}
	r, err := backend.Dial(ctx, backend.Config{URL: url, Credential: viaB.APIKey()})
	if err != nil {
		t.Fatalf("dialing %s through broker B: %v", url, err)
	}
	defer r.Close()
	var out bytes.Buffer
	res, err := r.Exec(ctx, backend.ExecRequest{ExecArgs: protocol.ExecArgs{Command: "echo hi"}, Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "hi\n" {
		t.Fatalf("exec through broker B: %v %+v %q", err, res, out.String())
	}
}
