package server

import (
	"context"
	"encoding/json"
	"runtime/debug"

	"github.com/sbxbroker/broker/protocol"
)

// dpOps is the one table of dataplane operations (docs/dataplane.md): for each op, the scope a
// credential needs, the resources it holds, its arguments and its handler. Dispatch reads nothing
// else, so adding an operation is one entry here and its handler beside its family's
// (dataplane_files.go, dataplane_exec.go).
var dpOps = map[string]dpOp{
	protocol.OpPing:   {class: opInline, inline: func(c *dpConn, id uint32) { c.send(protocol.Response{ID: id, Result: struct{}{}}) }},
	protocol.OpCancel: {class: opInline, inline: (*dpConn).cancelRequest},

	protocol.OpEnv:      op(protocol.ScopeFSRead, opLight, opEnv),
	protocol.OpStat:     op(protocol.ScopeFSRead, opLight, opStat).onOneFile(),
	protocol.OpLs:       op(protocol.ScopeFSRead, opHeavy, opLs).drawingMemory(),
	protocol.OpRead:     op(protocol.ScopeFSRead, opHeavy, opRead).onOneFile(),
	protocol.OpGlob:     op(protocol.ScopeFSRead, opHeavy, opGlob).drawingMemory(),
	protocol.OpGrep:     op(protocol.ScopeFSRead, opHeavy, opGrep).drawingMemory(),
	protocol.OpDownload: op(protocol.ScopeFSRead, opStreamed, opDownload),
	protocol.OpTar:      op(protocol.ScopeFSRead, opStreamed, opTar).drawingMemory(),
	protocol.OpChanges:  op(protocol.ScopeFSRead, opHeavy, opChanges).drawingMemory(),

	protocol.OpWrite:  op(protocol.ScopeFSWrite, opLight, opWrite).withBody().onOneFile().makingParents(),
	protocol.OpEdit:   op(protocol.ScopeFSWrite, opLight, opEdit).drawingMemory().onOneFile(),
	protocol.OpDelete: op(protocol.ScopeFSWrite, opLight, opDelete),
	protocol.OpMkdir:  op(protocol.ScopeFSWrite, opLight, opMkdir).onOneFile().makingParents(),
	protocol.OpMove:   op(protocol.ScopeFSWrite, opLight, opMove).onOneFile().makingParents(),
	protocol.OpUpload: op(protocol.ScopeFSWrite, opUpload, opUploadOpen),
	protocol.OpUntar:  op(protocol.ScopeFSWrite, opUpload, opUntarOpen),

	protocol.OpExec:   op(protocol.ScopeExec, opLight, opExec).startingOnReader(),
	protocol.OpShell:  op(protocol.ScopeExec, opLight, opShell).withPrepare(prepareShell),
	protocol.OpResize: {class: opInline, control: (*dpConn).resizeShell},
}

// dpOp is one dataplane operation.
type dpOp struct {
	// scope is what the credential must hold; "" lets any credential do it.
	scope string
	class opClass
	// run decodes the op's arguments (strictly, into the handler's argument type) and performs it.
	run func(ctx context.Context, c *dpConn, r *request, raw json.RawMessage) (any, error)
	// inline answers an opInline op on the reader's goroutine; its arguments are not read.
	inline func(c *dpConn, id uint32)
	// control is an opInline op that takes arguments (resize), run on the reader's goroutine.
	control func(c *dpConn, id uint32, raw json.RawMessage)
	// prepare, when set, runs on the reader's goroutine as the request starts, before any frame
	// that follows it is read: what those frames feed (a shell's input) is there for them.
	prepare func(c *dpConn, ctx context.Context, r *request)
	// bodyIn says the op's content comes as the body of a protocol.FrameRequestBody (write), which
	// it then must; no other op takes one. An op answers with a body (protocol.FrameAnswerBody) by
	// returning a *bodyAnswer (read).
	bodyIn bool
	// oneFile marks an op that touches one file or directory entry, a bounded amount of work: on a
	// sandbox whose files are local it may run on the reader's goroutine (dpConn.onReader).
	oneFile bool
	// makesParents marks a one-file op that creates its path's missing parents, a directory per
	// level: a deep one does not run on the reader.
	makesParents bool
	// startsOnReader marks an op that runs on the reader's goroutine until it would wait, and
	// then calls its request's started, which moves the reading to a new goroutine (exec).
	startsOnReader bool
	// drawsMemory marks an op that builds in memory what its own bounds allow (names, an answer,
	// a file's content): it draws that from the broker-wide op memory budget (dpOpMemoryBudget)
	// until its answer is written. An untar draws on it too, for as long as its extraction runs
	// (opUntarOpen).
	drawsMemory bool
}

// startingOnReader marks an op that starts on the reader (see dpOp.startsOnReader).
func (o dpOp) startingOnReader() dpOp { o.startsOnReader = true; return o }

// withPrepare gives an op a step run on the reader's goroutine as its request starts.
func (o dpOp) withPrepare(prepare func(c *dpConn, ctx context.Context, r *request)) dpOp {
	o.prepare = prepare
	return o
}

// drawingMemory marks an op that draws on the op memory budget (see dpOp.drawsMemory).
func (o dpOp) drawingMemory() dpOp { o.drawsMemory = true; return o }

// onOneFile marks an op whose work is one file's (see dpOp.oneFile).
func (o dpOp) onOneFile() dpOp { o.oneFile = true; return o }

// makingParents marks an op that creates missing parents (see dpOp.makesParents).
func (o dpOp) makingParents() dpOp { o.makesParents = true; return o }

// withBody marks an op whose content comes as the body of its request frame.
func (o dpOp) withBody() dpOp { o.bodyIn = true; return o }

// opClass says where an operation runs and what it holds of the shared resources until its answer
// is written to the client (docs/operations.md, dataplane limits).
type opClass int

const (
	// opInline is answered by the reader at once: never in flight, holding nothing (ping, cancel).
	opInline opClass = iota
	// opLight runs in its own goroutine and holds only its place among the requests in flight (an
	// exec's output is counted against the exec output budget by the exec itself).
	opLight
	// opHeavy can answer a lot at once: it holds a heavy slot of the connection (dpHeavyPerConn) and
	// one broker-wide within its org's share (dpHeavyPerBroker, dpHeavyPerOrg).
	opHeavy
	// opStreamed streams its answer in chunks bounded by the connection's write queue and lasts as
	// long as its reader is slow: it holds a heavy slot of the connection only, since broker-wide
	// slots held by slow readers would stall every other connection's reads.
	opStreamed
	// opUpload is opened on the reader's goroutine, so that the binary frames that follow find it,
	// and stays in flight until its end frame (dataplane.go's binary).
	opUpload
)

// op makes a table entry from a handler taking the op's typed arguments.
func op[A any](scope string, class opClass, handle func(ctx context.Context, c *dpConn, r *request, a A) (any, error)) dpOp {
	return dpOp{scope: scope, class: class, run: func(ctx context.Context, c *dpConn, r *request, raw json.RawMessage) (any, error) {
		var a A
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		return handle(ctx, c, r, a)
	}}
}

// run performs one operation, holding what its class holds. Without wait it does nothing and
// answers ran false when what the class holds is not free at once. An operation that panics is
// answered internal, with its stack in the log: it runs on a goroutine of its own or on the
// connection's reader, where no HTTP middleware would catch it, and a panic there would end the
// broker and every sandbox connection on it.
func (c *dpConn) run(ctx context.Context, r *request, o dpOp, raw json.RawMessage, wait bool) (res any, err error, ran bool) {
	defer func() {
		if p := recover(); p != nil {
			c.s.log.Error("dataplane operation panic", "sandbox_id", c.rec.ID, "request", r.id, "panic", p, "stack", string(debug.Stack()))
			res, err, ran = nil, protocol.Errorf(protocol.CodeInternal, "the operation failed inside the broker (a bug, logged there); nothing else on this connection is affected"), true
		}
	}()
	switch o.class {
	case opHeavy, opStreamed:
		if held, err := c.holdHeavy(ctx, r, o.class == opHeavy, wait); !held {
			return nil, err, err != nil
		}
	}
	if o.drawsMemory {
		var mem *opMemory
		ctx, mem = c.meterOp(ctx, "")
		r.hold.add(mem.free)
	}
	res, err = o.run(ctx, c, r, raw)
	return res, err, true
}
