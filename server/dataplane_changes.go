package server

import (
	"context"

	"github.com/sbxbroker/broker/protocol"
)

// changesFiles is what a sandbox's Files serve when they can compare a tree with its push baseline
// where the files are (the workspace directory on this host does).
type changesFiles interface {
	Changes(ctx context.Context, a protocol.ChangesArgs) (protocol.ChangesResult, error)
}

// opChanges lists what changed in a tree since its push (sbctl diff and pull). It reads only, so
// fs:read is enough: no exec, and no git in the sandbox.
func opChanges(ctx context.Context, c *dpConn, _ *request, a protocol.ChangesArgs) (any, error) {
	cf, ok := c.files.(changesFiles)
	if !ok {
		return nil, protocol.Errorf(protocol.CodeInvalidArgument, "this sandbox's provider cannot compare its files with a push baseline; copy them out with sbctl cp")
	}
	return cf.Changes(ctx, a)
}
