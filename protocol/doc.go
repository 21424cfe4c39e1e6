// Package protocol holds the broker's wire format and nothing else: REST bodies, the run-config block,
// delegation scopes, dataplane frames, events and error codes. Every other package (server, client,
// backend, the TypeScript example through protocol/testdata) agrees on these shapes.
//
// It imports only the standard library and none of our packages, so agent servers can depend on it
// without pulling in the broker.
package protocol
