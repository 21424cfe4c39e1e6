// Command sbx-init is a sandbox's resident init (see sandbox/provider/sbxinit): the program
// bubblewrap runs inside each sandbox, which forks commands on the broker's request. The broker
// binary can play this part itself; this small static program (build it with CGO_ENABLED=0) does it
// with a faster start and in a template rootfs without libc, and the broker uses it when it is
// installed next to the broker.
package main

import "github.com/sbxbroker/broker/sandbox/provider/sbxinit"

func main() { sbxinit.RunInit() }
