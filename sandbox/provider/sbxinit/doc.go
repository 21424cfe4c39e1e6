// Package sbxinit is a sandbox's resident init and the wire format it speaks with the broker: the
// program bubblewrap runs inside each sandbox (pid 1 of its pid namespace), which forks commands on
// the broker's request and reports their exits. The broker's side of the protocol is in
// sandbox/provider, which imports this package for the wire format.
//
// It is a leaf: it imports the standard library and golang.org/x/sys/unix only, nothing of the
// broker's, so cmd/sbx-init stays small and, built with CGO_ENABLED=0, static. A static init runs in
// a template's custom root filesystem that has no libc. tests/deps checks both.
//
// The control protocol: one SOCK_SEQPACKET message is one JSON object; the kernel keeps message
// boundaries, so there is no framing. File descriptors travel as SCM_RIGHTS on exec requests, and
// on the config: the pid table (pidtable.go), shared memory where the init writes each command's pid
// as it forks it, so that no reply per exec carries it.
// Where no fd can pass in from the host (gVisor), the bridge (bridge.go) carries the same messages
// and every command's stdio as frames on one byte stream, each command's channel within its own
// window (flow.go), so that no command's stalled reader holds up another's.
package sbxinit
