// Package mcp is the broker's Model Context Protocol front end: an MCP server (the official Go SDK,
// github.com/modelcontextprotocol/go-sdk) whose tools (read_file, write_file, edit_file, ls, glob,
// grep, execute) are the dataplane's operations, called through backend.Remote with a delegation
// token. It adds no behaviour of its own: scopes, the command allowlist, limits, revocation and
// events are the dataplane's, and results are the dataplane's results as the broker sent them.
//
// Two transports serve it: stdio (sbctl mcp, NewServer + sdk StdioTransport) and Streamable HTTP
// on the broker (HTTP, behind /v1/sandboxes/{id}/mcp). The package speaks only the dataplane's wire
// format (package protocol, package backend); it never imports the broker's server or its domain
// packages.
package mcp
