package mcp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sbxbroker/broker/protocol"
)

// Dataplane runs one dataplane operation and returns its result as the broker sent it.
// *backend.Remote is one.
type Dataplane interface {
	Call(ctx context.Context, op string, args any) (json.RawMessage, error)
}

// Options configure a server's tools.
type Options struct {
	// Scopes are the token's scopes: a tool they do not allow is not listed.
	Scopes []string
	// AllowCmd is the token's command allowlist, named in execute's description (the dataplane
	// enforces it).
	AllowCmd []string
	// Version is reported as the server's version.
	Version string
	// ProgressEvery is how often execute reports progress while a command runs, to a client that
	// asked for progress (default 1s).
	ProgressEvery time.Duration
	// MaxArgBytes bounds one tool call's arguments (default DefaultMaxArgBytes); larger calls are
	// refused with a JSON-RPC invalid-params error and reach no sandbox.
	MaxArgBytes int
	Logger      *slog.Logger
}

// DefaultMaxArgBytes bounds one tool call's arguments: a write's content must fit one dataplane
// frame (1 MiB of payload and 64 KiB of headroom).
const DefaultMaxArgBytes = 1 << 20

// Tool names, as agents know them (deepagents' filesystem and shell tools).
const (
	ToolLs      = "ls"
	ToolRead    = "read_file"
	ToolWrite   = "write_file"
	ToolEdit    = "edit_file"
	ToolGlob    = "glob"
	ToolGrep    = "grep"
	ToolExecute = "execute"
)

// ToolScopes says which scope each tool needs: the dataplane's scope of the operation it calls.
var ToolScopes = map[string]string{
	ToolLs: protocol.ScopeFSRead, ToolRead: protocol.ScopeFSRead, ToolGlob: protocol.ScopeFSRead, ToolGrep: protocol.ScopeFSRead,
	ToolWrite: protocol.ScopeFSWrite, ToolEdit: protocol.ScopeFSWrite,
	ToolExecute: protocol.ScopeExec,
}

// Tool arguments. Unknown fields and wrong types are refused before anything reaches the sandbox.
type lsArgs struct {
	Path string `json:"path,omitempty" jsonschema:"directory to list (default /workspace)"`
}

type readArgs struct {
	FilePath string `json:"file_path" jsonschema:"file to read: absolute under /workspace, or relative to it"`
	Offset   int    `json:"offset,omitempty" jsonschema:"first line to read, 0-based"`
	Limit    int    `json:"limit,omitempty" jsonschema:"number of lines to read (default: to the end, up to the broker's read cap)"`
}

type writeArgs struct {
	FilePath string `json:"file_path" jsonschema:"file to write (created with its parents, or replaced)"`
	Content  string `json:"content" jsonschema:"the file's whole new content"`
}

type editArgs struct {
	FilePath   string `json:"file_path" jsonschema:"file to edit"`
	OldString  string `json:"old_string" jsonschema:"exact text to replace; it must occur exactly once unless replace_all"`
	NewString  string `json:"new_string" jsonschema:"replacement text"`
	ReplaceAll bool   `json:"replace_all,omitempty" jsonschema:"replace every occurrence"`
}

type globArgs struct {
	Pattern string `json:"pattern" jsonschema:"glob pattern; ** matches any number of directories"`
	Path    string `json:"path,omitempty" jsonschema:"directory to search under (default /workspace)"`
}

type grepArgs struct {
	Pattern    string `json:"pattern" jsonschema:"text to search for (a literal string unless regex)"`
	Path       string `json:"path,omitempty" jsonschema:"file or directory to search (default /workspace)"`
	Glob       string `json:"glob,omitempty" jsonschema:"only files whose path relative to path matches this glob, e.g. *.go"`
	Regex      bool   `json:"regex,omitempty" jsonschema:"treat pattern as an RE2 regular expression"`
	IgnoreCase bool   `json:"ignore_case,omitempty" jsonschema:"match case-insensitively"`
	MaxCount   int    `json:"max_count,omitempty" jsonschema:"maximum matches returned"`
}

type executeArgs struct {
	Command   string `json:"command" jsonschema:"shell command, run with /bin/sh -c in /workspace"`
	Cwd       string `json:"cwd,omitempty" jsonschema:"working directory (default /workspace)"`
	TimeoutMS int64  `json:"timeout_ms,omitempty" jsonschema:"kill the command after this many milliseconds (default 10 minutes)"`
}

// NewServer builds an MCP server whose tools call dp. Only the tools opts.Scopes allow are added.
func NewServer(dp Dataplane, opts Options) *sdk.Server {
	return newServer(func(context.Context, *sdk.CallToolRequest) (Dataplane, error) { return dp, nil }, opts)
}

// resolver finds the dataplane of a tool call's session.
type resolver func(ctx context.Context, req *sdk.CallToolRequest) (Dataplane, error)

func newServer(dp resolver, opts Options) *sdk.Server {
	if opts.ProgressEvery <= 0 {
		opts.ProgressEvery = time.Second
	}
	if opts.MaxArgBytes <= 0 {
		opts.MaxArgBytes = DefaultMaxArgBytes
	}
	if opts.Version == "" {
		opts.Version = "dev"
	}
	srv := sdk.NewServer(&sdk.Implementation{Name: "sbx-sandbox", Title: "sandbox", Version: opts.Version}, &sdk.ServerOptions{
		Logger:       opts.Logger,
		Capabilities: &sdk.ServerCapabilities{Tools: &sdk.ToolCapabilities{}},
		Instructions: "Tools work on one sandbox: files live under /workspace and commands run there. " +
			"Only the tools this credential allows are listed.",
	})
	addTools(srv, dp, opts)
	return srv
}

type toolDef struct {
	name, desc string
	schema     *jsonschema.Schema
	readOnly   bool
	run        func(ctx context.Context, req *sdk.CallToolRequest, raw json.RawMessage) (*sdk.CallToolResult, error)
}

func addTools(srv *sdk.Server, dp resolver, o Options) {
	allowed := map[string]bool{}
	for _, s := range o.Scopes {
		allowed[s] = true
	}
	execDesc := "Run a shell command in the sandbox and return its exit code, stdout and stderr. Output past 1 MiB is " +
		"dropped and the result says truncated; the command is killed at its timeout."
	if len(o.AllowCmd) > 0 {
		execDesc += " Only these programs may run, as simple commands (no pipes, redirections or substitutions): " +
			strings.Join(o.AllowCmd, ", ") + "."
	}
	defs := []toolDef{
		{ToolLs, "List a directory of the sandbox (not recursive).", lsSchema, true,
			simple(dp, o, protocol.OpLs, func(a lsArgs) (any, error) { return protocol.LsArgs{Path: orWorkspace(a.Path)}, nil }, renderLs)},
		{ToolRead, "Read a file of the sandbox, whole or a window of lines (offset, limit).", readSchema, true,
			simple(dp, o, protocol.OpRead, func(a readArgs) (any, error) {
				if a.FilePath == "" {
					return nil, errors.New("file_path is required")
				}
				if a.Offset < 0 || a.Limit < 0 {
					return nil, errors.New("offset and limit must not be negative")
				}
				return protocol.ReadArgs{Path: a.FilePath, LineOffset: a.Offset, LineLimit: a.Limit}, nil
			}, renderRead)},
		{ToolWrite, "Write a whole file in the sandbox, creating it and its parent directories, or replacing it.", writeSchema, false,
			simple(dp, o, protocol.OpWrite, func(a writeArgs) (any, error) {
				if a.FilePath == "" {
					return nil, errors.New("file_path is required")
				}
				return protocol.WriteArgs{Path: a.FilePath, Content: a.Content}, nil
			}, renderJSON)},
		{ToolEdit, "Replace exact text in a file of the sandbox. old_string must occur exactly once unless replace_all is set; the result says how many occurrences were replaced.",
			editSchema, false,
			simple(dp, o, protocol.OpEdit, func(a editArgs) (any, error) {
				if a.FilePath == "" || a.OldString == "" {
					return nil, errors.New("file_path and old_string are required")
				}
				return protocol.EditArgs{Path: a.FilePath, Old: a.OldString, New: a.NewString, ReplaceAll: a.ReplaceAll}, nil
			}, renderJSON)},
		{ToolGlob, "Find files of the sandbox whose paths match a glob pattern.", globSchema, true,
			simple(dp, o, protocol.OpGlob, func(a globArgs) (any, error) {
				if a.Pattern == "" {
					return nil, errors.New("pattern is required")
				}
				return protocol.GlobArgs{Pattern: a.Pattern, Path: a.Path}, nil
			}, renderGlob)},
		{ToolGrep, "Search file contents in the sandbox (binary files are skipped); answers path:line:text per match.", grepSchema, true,
			simple(dp, o, protocol.OpGrep, func(a grepArgs) (any, error) {
				if a.Pattern == "" {
					return nil, errors.New("pattern is required")
				}
				if a.MaxCount < 0 {
					return nil, errors.New("max_count must not be negative")
				}
				return protocol.GrepArgs{Pattern: a.Pattern, Path: a.Path, Glob: a.Glob, Regex: a.Regex, IgnoreCase: a.IgnoreCase, MaxCount: a.MaxCount}, nil
			}, renderGrep)},
		{ToolExecute, execDesc, executeSchema, false, executeTool(dp, o)},
	}
	for _, d := range defs {
		if !allowed[ToolScopes[d.name]] {
			continue
		}
		t := &sdk.Tool{Name: d.name, Description: d.desc, InputSchema: d.schema,
			Annotations: &sdk.ToolAnnotations{ReadOnlyHint: d.readOnly, DestructiveHint: boolPtr(!d.readOnly), OpenWorldHint: boolPtr(false)}}
		run := d.run
		srv.AddTool(t, func(ctx context.Context, req *sdk.CallToolRequest) (*sdk.CallToolResult, error) {
			raw := req.Params.Arguments
			if len(raw) > o.MaxArgBytes {
				return nil, invalidParams("the arguments are %d bytes, over this server's limit of %d; write large files with sbctl cp", len(raw), o.MaxArgBytes)
			}
			return run(ctx, req, raw)
		})
	}
}

func boolPtr(b bool) *bool { return &b }

func orWorkspace(p string) string {
	if p == "" {
		return "/workspace"
	}
	return p
}

// The tools' input schemas, made once.
var (
	lsSchema      = schemaFor[lsArgs]()
	readSchema    = schemaFor[readArgs]()
	writeSchema   = schemaFor[writeArgs]()
	editSchema    = schemaFor[editArgs]()
	globSchema    = schemaFor[globArgs]()
	grepSchema    = schemaFor[grepArgs]()
	executeSchema = schemaFor[executeArgs]()
)

func schemaFor[T any]() *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(err) // the argument types are ours: a failure is a bug found by every test
	}
	return s
}

func invalidParams(format string, args ...any) error {
	return &jsonrpc.Error{Code: jsonrpc.CodeInvalidParams, Message: fmt.Sprintf(format, args...)}
}

// decodeArgs decodes a tool's arguments strictly: one JSON object, known fields of the right types.
// Any failure is a JSON-RPC invalid-params error: the call was malformed, and nothing ran.
func decodeArgs(raw json.RawMessage, v any) error {
	if len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null" {
		raw = json.RawMessage("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return invalidParams("invalid arguments: %s", argError(err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return invalidParams("invalid arguments: more than one JSON value")
	}
	return nil
}

func argError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		if te.Field != "" {
			return fmt.Sprintf("%s must be %s, not %s", te.Field, jsonKind(te.Type.Kind().String()), te.Value)
		}
		return "the arguments must be a JSON object, not " + te.Value
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}

func jsonKind(k string) string {
	switch {
	case strings.HasPrefix(k, "int"), strings.HasPrefix(k, "uint"):
		return "an integer"
	case k == "bool":
		return "a boolean"
	case k == "string":
		return "a string"
	}
	return k
}

// simple is a tool that decodes its arguments, maps them to one dataplane operation and renders
// the operation's result.
func simple[A any](resolve resolver, o Options, op string, args func(A) (any, error), render func(json.RawMessage) string) func(context.Context, *sdk.CallToolRequest, json.RawMessage) (*sdk.CallToolResult, error) {
	return func(ctx context.Context, req *sdk.CallToolRequest, raw json.RawMessage) (*sdk.CallToolResult, error) {
		var a A
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		dpArgs, err := args(a)
		if err != nil {
			return nil, invalidParams("invalid arguments: %v", err)
		}
		dp, err := resolve(ctx, req)
		if err != nil {
			return failure(ctx, err)
		}
		res, err := dp.Call(ctx, op, dpArgs)
		if err != nil {
			return failure(ctx, err)
		}
		return success(res, render(res)), nil
	}
}

// success carries the dataplane's result unchanged as the structured content, and a rendering of
// it for the model as text.
func success(res json.RawMessage, text string) *sdk.CallToolResult {
	return &sdk.CallToolResult{Content: []sdk.Content{&sdk.TextContent{Text: text}}, StructuredContent: res}
}

// failure turns a dataplane refusal into a tool error that carries the dataplane's own error (code
// and message), so a model reads why; a cancelled call stays an error of the call.
func failure(ctx context.Context, err error) (*sdk.CallToolResult, error) {
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	var pe *protocol.Error
	if !errors.As(err, &pe) {
		pe = &protocol.Error{Code: protocol.CodeInternal, Message: err.Error()}
	}
	body, _ := json.Marshal(protocol.ErrorBody{Error: *pe})
	return &sdk.CallToolResult{IsError: true, Content: []sdk.Content{&sdk.TextContent{Text: pe.Code + ": " + pe.Message}},
		StructuredContent: json.RawMessage(body)}, nil
}

func renderJSON(res json.RawMessage) string { return string(res) }

func renderRead(res json.RawMessage) string {
	var r protocol.ReadResult
	if json.Unmarshal(res, &r) != nil {
		return string(res)
	}
	if r.Encoding == protocol.EncodingBase64 {
		return fmt.Sprintf("%s is a binary file of %d bytes; its base64 content is in the structured result.", r.Path, r.Size)
	}
	return r.Content
}

func renderLs(res json.RawMessage) string {
	var r protocol.LsResult
	if json.Unmarshal(res, &r) != nil {
		return string(res)
	}
	var b strings.Builder
	for _, e := range r.Entries {
		b.WriteString(e.Path)
		if e.Type == protocol.FileTypeDir {
			b.WriteString("/")
		}
		b.WriteString("\n")
	}
	if r.Truncated {
		b.WriteString("(truncated: narrow the listing with glob)\n")
	}
	return b.String()
}

func renderGlob(res json.RawMessage) string {
	var r protocol.GlobResult
	if json.Unmarshal(res, &r) != nil {
		return string(res)
	}
	var b strings.Builder
	for _, e := range r.Files {
		b.WriteString(e.Path + "\n")
	}
	switch {
	case r.Truncated && len(r.Files) == 0:
		b.WriteString("(no path matched in what was searched, but the search stopped before the whole tree was searched: a limit cut it, so a match may still exist; narrow the pattern or path)\n")
	case r.Truncated:
		b.WriteString("(truncated)\n")
	}
	return b.String()
}

func renderGrep(res json.RawMessage) string {
	var r protocol.GrepResult
	if json.Unmarshal(res, &r) != nil {
		return string(res)
	}
	var b strings.Builder
	for _, m := range r.Matches {
		fmt.Fprintf(&b, "%s:%d:%s\n", m.Path, m.Line, m.Text)
	}
	// Truncated means more matches than max_count or a cap (time, bytes read, entries, glob work)
	// stopped the search: an agent must not read the matches given, or none, as all there are.
	switch {
	case r.Truncated && len(r.Matches) == 0:
		b.WriteString("(no match in what was searched, but the search stopped before every file was searched: a limit cut it, so the text may still be there; narrow path or glob)\n")
	case r.Truncated:
		b.WriteString("(truncated: more matches may exist, or a limit stopped the search before every file was searched; narrow path or glob)\n")
	}
	return b.String()
}

func renderExec(res json.RawMessage) string {
	var r protocol.ExecResult
	if json.Unmarshal(res, &r) != nil {
		return string(res)
	}
	var b strings.Builder
	if r.Stdout != nil {
		b.WriteString(*r.Stdout)
	}
	if r.Stderr != nil && *r.Stderr != "" {
		if b.Len() > 0 && !strings.HasSuffix(b.String(), "\n") {
			b.WriteString("\n")
		}
		b.WriteString("[stderr]\n" + *r.Stderr)
	}
	if b.Len() > 0 && !strings.HasSuffix(b.String(), "\n") {
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "[exit code %d", r.ExitCode)
	if r.Reason != "" {
		b.WriteString(", " + r.Reason)
	}
	if r.Truncated {
		b.WriteString(", output truncated")
	}
	b.WriteString("]")
	return b.String()
}

// executeTool runs a command (never retried) and, when the client asked for progress, reports the
// time it has run every ProgressEvery until it ends. Cancelling the call cancels the command.
func executeTool(resolve resolver, o Options) func(context.Context, *sdk.CallToolRequest, json.RawMessage) (*sdk.CallToolResult, error) {
	return func(ctx context.Context, req *sdk.CallToolRequest, raw json.RawMessage) (*sdk.CallToolResult, error) {
		var a executeArgs
		if err := decodeArgs(raw, &a); err != nil {
			return nil, err
		}
		if a.Command == "" {
			return nil, invalidParams("invalid arguments: command is required")
		}
		if a.TimeoutMS < 0 {
			return nil, invalidParams("invalid arguments: timeout_ms must not be negative")
		}
		dp, err := resolve(ctx, req)
		if err != nil {
			return failure(ctx, err)
		}
		if tok := req.Params.GetProgressToken(); tok != nil && req.Session != nil {
			stop := make(chan struct{})
			defer close(stop)
			go reportProgress(ctx, req.Session, tok, o.ProgressEvery, a.TimeoutMS, stop)
		}
		res, err := dp.Call(ctx, protocol.OpExec, protocol.ExecArgs{Command: a.Command, Cwd: a.Cwd, TimeoutMS: a.TimeoutMS})
		if err != nil {
			return failure(ctx, err)
		}
		return success(res, renderExec(res)), nil
	}
}

func reportProgress(ctx context.Context, ss *sdk.ServerSession, tok any, every time.Duration, timeoutMS int64, stop <-chan struct{}) {
	start := time.Now()
	t := time.NewTicker(every)
	defer t.Stop()
	total := float64(protocol.ExecDefaultTimeout / time.Second)
	if timeoutMS > 0 {
		total = float64(timeoutMS) / 1000
	}
	for {
		select {
		case <-stop:
			return
		case <-ctx.Done():
			return
		case <-t.C:
			el := time.Since(start).Seconds()
			ss.NotifyProgress(ctx, &sdk.ProgressNotificationParams{ProgressToken: tok, Progress: el, Total: total,
				Message: fmt.Sprintf("running for %.0fs", el)})
		}
	}
}
