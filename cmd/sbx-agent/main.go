// Command sbx-agent is a sandbox's resident init when the broker reaches the sandbox over the
// network rather than a local socket: the kubernetes provider's pods run it as their entrypoint.
// It serves the sandbox's commands and files on TCP port 7450 to the holder of the sandbox's
// secret (see sandbox/provider/agent). Build it static (CGO_ENABLED=0) and put it in the sandbox
// image; it is apart from cmd/sbx-init, which must stay a leaf without a network stack.
//
// It speaks only TLS 1.3, with the sandbox's certificate and key, and refuses to start without them.
//
// Environment: SBX_AGENT_SECRET_FILE (default /run/sbx/secret), SBX_AGENT_TLS_CERT and
// SBX_AGENT_TLS_KEY (default tls.crt and tls.key beside the secret), SBX_AGENT_ADDR (default
// :7450), SBX_AGENT_WORKSPACE (default /workspace).
package main

import "github.com/sbxbroker/broker/sandbox/provider/agent"

func main() { agent.Main() }
