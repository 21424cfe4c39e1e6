// Command sbx-init is a sandbox's resident init (see sandbox/provider): the program bubblewrap
// runs inside each sandbox, which forks commands on the broker's request. The broker binary can
// play this part itself; this small program does it with a faster start, and the broker uses it
// when it is installed next to the broker.
package main

import "github.com/sbxbroker/broker/sandbox/provider"

func main() { provider.RunInit() }
