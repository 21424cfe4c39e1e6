// Package mcp is the broker's Model Context Protocol front end: an MCP server (the official Go SDK,
// github.com/modelcontextprotocol/go-sdk) whose tools (read_file, write_file, edit_file, ls, glob,
// grep, execute) are the dataplane's operations, called on a dataplane connection (Dataplane, Conn)
// with a delegation token. It adds no behaviour of its own: scopes, the command allowlist, limits,
// revocation and events are the dataplane's, and results are the dataplane's results as the broker
// encodes them.
//
// Two transports serve it: stdio (sbctl mcp, NewServer + sdk StdioTransport, over a backend.Remote)
// and Streamable HTTP on the broker (HTTP, behind /v1/sandboxes/{id}/mcp, whose sessions the broker
// gives in-process dataplane connections). The package speaks only the dataplane's operations and
// wire types (package protocol); it never imports the broker's server or its domain packages.
package mcp
