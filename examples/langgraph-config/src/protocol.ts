// The dataplane's wire types (sbx.dataplane.v2). docs/dataplane.md is the normative spec and
// protocol/*.go the Go side; field names here are exactly the JSON keys. Decoders refuse wrong types
// and missing fields. Unknown keys are refused in client frames and in strict mode (the golden-frame
// tests); frames from the broker are read leniently (unknown keys dropped), so a broker that adds a
// field does not break its clients. Encoders write back exactly the keys that are present, so a
// frame decoded strictly re-encodes to the same JSON.

import { isUtf8 } from "node:buffer";

/** The dataplane's WebSocket subprotocol; a client must offer it. */
export const SUBPROTOCOL = "sbx.dataplane.v2";

/** Binary frame kinds: byte 0 of a binary frame. */
export const FrameKind = {
  Stdout: 1, // server -> client: exec output (all of it when combined)
  Stderr: 2, // server -> client: exec stderr
  Data: 3, // both ways: upload and download bytes
  End: 4, // client -> server: the upload is complete (empty payload)
  RequestBody: 5, // client -> server: a request and its body (a write's content)
  AnswerBody: 6, // server -> client: an answer and its body (a read's content)
} as const;
export type FrameKindValue = (typeof FrameKind)[keyof typeof FrameKind];
/** A binary frame is [kind u8][request id u32 big-endian], then the payload. */
export const FRAME_HEADER_LEN = 5;
/** A frame with a body (kinds 5, 6) has a 4-byte big-endian JSON length after the header, then the JSON, then the body. */
export const BODY_HEADER_LEN = 9;

/** Close codes the broker uses besides the standard ones; the close reason is the error code. */
export const CloseCode = {
  CredentialEnded: 4001, // token_revoked / token_expired / unauthenticated: final
  SandboxGone: 4002, // sandbox_not_running / not_found: final
} as const;

/** Stable error codes (protocol/errors.go) that the dataplane and its handshake answer with. */
export const ErrorCode = {
  InvalidJSON: "invalid_json",
  InvalidArgument: "invalid_argument",
  UnknownOp: "unknown_op",
  ScopeDenied: "scope_denied",
  CommandNotAllowed: "command_not_allowed",
  InvalidPath: "invalid_path",
  FileNotFound: "file_not_found",
  IsDirectory: "is_directory",
  NotDirectory: "not_directory",
  FileExists: "file_exists",
  PermissionDenied: "permission_denied",
  NoMatch: "no_match",
  NotUnique: "not_unique",
  TooLarge: "payload_too_large",
  TooManyRequests: "too_many_requests",
  Cancelled: "cancelled",
  NotRunning: "sandbox_not_running",
  Internal: "internal",
  Unavailable: "unavailable",
  Unauthenticated: "unauthenticated",
  Forbidden: "forbidden",
  NotFound: "not_found",
  WrongNode: "wrong_node",
  TokenExpired: "token_expired",
  TokenRevoked: "token_revoked",
  TokenWrongSandbox: "token_wrong_sandbox",
  /** Client side: the dataplane could not be reached or the connection broke. */
  Unreachable: "unreachable",
  /** Client side: the run's config.configurable.sandbox block is missing or malformed. */
  InvalidRunConfig: "invalid_run_config",
} as const;

// ---- Types (protocol/dataplane.go, protocol/files.go) ----

export interface Limits {
  max_frame_bytes: number;
  max_inflight: number;
  max_chunk_bytes: number;
  max_output_bytes: number;
}

export interface Hello {
  protocol: string;
  sandbox_id: string;
  workspace: string;
  scopes: string[];
  allow_cmd?: string[];
  expires_at?: string;
  limits: Limits;
}

export interface WireError {
  code: string;
  message: string;
  request_id?: string;
}

export interface FileInfo {
  path: string;
  name: string;
  type: "file" | "dir" | "symlink" | "other" | string;
  size: number;
  mode: number;
  mod_time: string;
  target?: string;
}

export interface PathArgs {
  path: string;
}
export interface ReadArgs {
  path: string;
  offset?: number;
  length?: number;
  line_offset?: number;
  line_limit?: number;
}
export interface WriteArgs {
  path: string;
  content: string;
  encoding?: "utf-8" | "base64";
  mode?: "overwrite" | "create";
}
/** A write's args on the wire: its content is the body of its frame (FrameKind.RequestBody). */
export interface WriteHead {
  path: string;
  mode?: "overwrite" | "create";
}
export interface EditArgs {
  path: string;
  old: string;
  new: string;
  replace_all?: boolean;
}
export interface DeleteArgs {
  path: string;
  recursive?: boolean;
}
export interface MkdirArgs {
  path: string;
  parents?: boolean;
}
export interface MoveArgs {
  from: string;
  to: string;
  overwrite?: boolean;
}
export interface GlobArgs {
  pattern: string;
  path?: string;
}
export interface GrepArgs {
  pattern: string;
  path?: string;
  glob?: string;
  regex?: boolean;
  ignore_case?: boolean;
  max_count?: number;
}
/** A tree (path alone), or a batch of files in the directory path (paths, relative to it): see docs/dataplane.md. */
export interface TarArgs {
  path: string;
  paths?: string[];
}
export interface UploadArgs {
  path: string;
  mode?: "overwrite" | "create";
}
export interface ExecArgs {
  command?: string;
  argv?: string[];
  cwd?: string;
  env?: Record<string, string>;
  stdin?: string;
  timeout_ms?: number;
  stream?: boolean;
  combined?: boolean;
  max_output?: number;
  background?: boolean;
}

/** A shell: an interactive program on a terminal (docs/dataplane.md, "shell"). This backend does not start one; the codec knows it so that every golden frame checks. */
export interface ShellArgs {
  argv?: string[];
  cwd?: string;
  env?: Record<string, string>;
  term?: string;
  rows?: number;
  cols?: number;
}
/** A shell's new window; sent with the shell's own id and never answered. */
export interface ResizeArgs {
  rows: number;
  cols: number;
}
/** What differs in a pushed tree from its baseline (sbctl push / diff / pull). */
export interface ChangesArgs {
  path?: string;
  paths?: string[];
}

export interface LsResult {
  entries: FileInfo[] | null;
  /** The directory has more entries than the broker's cap (10,000); narrow with glob. */
  truncated?: boolean;
}
export interface ReadResult extends ReadHead {
  content: string;
  encoding: "utf-8" | "base64" | string;
}
/** A read's answer on the wire: its content is the body of its frame (FrameKind.AnswerBody), raw bytes. */
export interface ReadHead {
  path: string;
  size: number;
  total_lines?: number;
  /** The broker stopped counting at its scan cap (64 MiB): the file has at least total_lines lines. */
  total_lines_partial?: boolean;
  truncated?: boolean;
}
export interface WriteResult {
  path: string;
  size: number;
  created: boolean;
}
export interface EditResult {
  path: string;
  occurrences: number;
}
export interface PathResult {
  path: string;
}
export interface GlobResult {
  files: FileInfo[] | null;
  truncated?: boolean;
}
export interface GrepMatch {
  path: string;
  line: number;
  text: string;
}
export interface GrepResult {
  matches: GrepMatch[] | null;
  truncated?: boolean;
}
export interface EnvResult {
  env: Record<string, string>;
}
export interface ExecResult {
  exit_code: number;
  signal?: string;
  reason?: string;
  truncated?: boolean;
  duration_ms: number;
  pid?: number;
  output?: string;
  stdout?: string;
  stderr?: string;
}
export interface DownloadResult {
  path: string;
  size: number;
}
/** What an untar extracted or a tar archived (bytes counts file content). */
export interface TreeResult {
  path: string;
  files: number;
  dirs: number;
  symlinks: number;
  bytes: number;
  skipped?: number;
  /** A tar with paths: the paths left out, each with what a download of it would have answered. */
  errors?: PathError[];
}
/** One path of a batch that failed on its own (path as asked). */
export interface PathError {
  path: string;
  code: string;
  message: string;
}
export interface Change {
  path: string;
  status: "added" | "modified" | "deleted" | string;
  mode?: string;
  oid?: string;
  size?: number;
}
export interface ChangesResult {
  path: string;
  commit: string;
  changes: Change[] | null;
  scanned: number;
  hashed: number;
  skipped?: string[];
}
export type Empty = Record<string, never>;

/** Each operation's arguments and result. */
export interface Ops {
  ping: { args: undefined; result: Empty };
  env: { args: undefined; result: EnvResult };
  stat: { args: PathArgs; result: FileInfo };
  ls: { args: PathArgs; result: LsResult };
  read: { args: ReadArgs; result: ReadResult };
  write: { args: WriteArgs; result: WriteResult };
  edit: { args: EditArgs; result: EditResult };
  delete: { args: DeleteArgs; result: PathResult };
  mkdir: { args: MkdirArgs; result: PathResult };
  move: { args: MoveArgs; result: PathResult };
  glob: { args: GlobArgs; result: GlobResult };
  grep: { args: GrepArgs; result: GrepResult };
  upload: { args: UploadArgs; result: WriteResult };
  download: { args: PathArgs; result: DownloadResult };
  untar: { args: PathArgs; result: TreeResult };
  tar: { args: TarArgs; result: TreeResult };
  exec: { args: ExecArgs; result: ExecResult };
  changes: { args: ChangesArgs; result: ChangesResult };
  shell: { args: ShellArgs; result: ExecResult };
  /** Never answered: it changes the window of the shell whose id it carries. */
  resize: { args: ResizeArgs; result: Empty };
}
export type Op = keyof Ops;
export type ArgsOf<O extends Op> = Ops[O]["args"];
export type ResultOf<O extends Op> = Ops[O]["result"];

/** A client text frame. A cancel names the request it cancels by that request's own id. */
export type ClientFrame =
  | { [O in Op]: { id: number; op: O; args?: ArgsOf<O> } }[Op]
  | { id: number; op: "cancel" };

/** A server text frame: the hello, or the end of one request (a result or an error). */
export type ServerFrame =
  | { id: number; type: "hello"; hello: Hello }
  | { id: number; result: unknown }
  | { id: number; error: WireError };

// ---- A small strict codec ----

type Kind =
  | "string"
  | "uint32"
  | "int"
  | "bool"
  | "string[]"
  | "string-map"
  | { object: Schema }
  | { array: Schema; nullable?: boolean };
interface Field {
  k: Kind;
  /** The Go side always writes it (no omitempty): decoding requires it. */
  req?: boolean;
}
type Schema = Record<string, Field>;

/** A frame or value that does not match the protocol's types. */
export class ProtocolError extends Error {
  override name = "ProtocolError";
}

const r = (k: Kind): Field => ({ k, req: true });
const o = (k: Kind): Field => ({ k });

const fileInfo: Schema = {
  path: r("string"),
  name: r("string"),
  type: r("string"),
  size: r("int"),
  mode: r("uint32"),
  mod_time: r("string"),
  target: o("string"),
};

/** Argument schemas by op (ping, env and cancel take none). */
export const argSchemas: Record<Exclude<Op, "ping" | "env">, Schema> = {
  stat: { path: r("string") },
  ls: { path: r("string") },
  download: { path: r("string") },
  untar: { path: r("string") },
  tar: { path: r("string"), paths: o("string[]") },
  read: { path: r("string"), offset: o("int"), length: o("int"), line_offset: o("int"), line_limit: o("int") },
  // On the wire a write's content is its frame's body (WriteHead); WriteArgs' content leaves there.
  write: { path: r("string"), mode: o("string") },
  edit: { path: r("string"), old: r("string"), new: r("string"), replace_all: o("bool") },
  delete: { path: r("string"), recursive: o("bool") },
  mkdir: { path: r("string"), parents: o("bool") },
  move: { from: r("string"), to: r("string"), overwrite: o("bool") },
  glob: { pattern: r("string"), path: o("string") },
  grep: {
    pattern: r("string"),
    path: o("string"),
    glob: o("string"),
    regex: o("bool"),
    ignore_case: o("bool"),
    max_count: o("int"),
  },
  upload: { path: r("string"), mode: o("string") },
  exec: {
    command: o("string"),
    argv: o("string[]"),
    cwd: o("string"),
    env: o("string-map"),
    stdin: o("string"),
    timeout_ms: o("int"),
    stream: o("bool"),
    combined: o("bool"),
    max_output: o("int"),
    background: o("bool"),
  },
  changes: { path: o("string"), paths: o("string[]") },
  shell: { argv: o("string[]"), cwd: o("string"), env: o("string-map"), term: o("string"), rows: o("int"), cols: o("int") },
  resize: { rows: r("int"), cols: r("int") },
};

const pathResult: Schema = { path: r("string") };
const writeResult: Schema = { path: r("string"), size: r("int"), created: r("bool") };

/** Result schemas by result kind; resultKindOf maps an op to its kind. */
export const resultSchemas = {
  ping: {} as Schema,
  stat: fileInfo,
  ls: { entries: r({ array: fileInfo, nullable: true }), truncated: o("bool") },
  // On the wire a read's content is its answer frame's body (ReadHead); the client makes the ReadResult.
  read: {
    path: r("string"),
    size: r("int"),
    total_lines: o("int"),
    total_lines_partial: o("bool"),
    truncated: o("bool"),
  },
  write: writeResult,
  edit: { path: r("string"), occurrences: r("int") },
  path: pathResult,
  glob: { files: r({ array: fileInfo, nullable: true }), truncated: o("bool") },
  grep: {
    matches: r({ array: { path: r("string"), line: r("int"), text: r("string") }, nullable: true }),
    truncated: o("bool"),
  },
  env: { env: r("string-map") },
  exec: {
    exit_code: r("int"),
    signal: o("string"),
    reason: o("string"),
    truncated: o("bool"),
    duration_ms: r("int"),
    pid: o("int"),
    output: o("string"),
    stdout: o("string"),
    stderr: o("string"),
  },
  download: { path: r("string"), size: r("int") },
  tree: {
    path: r("string"),
    files: r("int"),
    dirs: r("int"),
    symlinks: r("int"),
    bytes: r("int"),
    skipped: o("int"),
    errors: o({ array: { path: r("string"), code: r("string"), message: r("string") } }),
  },
  changes: {
    path: r("string"),
    commit: r("string"),
    changes: r({
      array: { path: r("string"), status: r("string"), mode: o("string"), oid: o("string"), size: o("int") },
      nullable: true,
    }),
    scanned: r("int"),
    hashed: r("int"),
    skipped: o("string[]"),
  },
} satisfies Record<string, Schema>;
export type ResultKind = keyof typeof resultSchemas;

/** The result kind an op answers with (delete, mkdir and move answer {path}; upload like write;
 * untar and tar a tree; a shell like an exec; resize is never answered). */
export function resultKindOf(op: Op): ResultKind {
  switch (op) {
    case "delete":
    case "mkdir":
    case "move":
      return "path";
    case "upload":
      return "write";
    case "untar":
    case "tar":
      return "tree";
    case "shell":
      return "exec";
    case "resize":
      return "ping";
    default:
      return op;
  }
}

const helloSchema: Schema = {
  protocol: r("string"),
  sandbox_id: r("string"),
  workspace: r("string"),
  scopes: r("string[]"),
  allow_cmd: o("string[]"),
  expires_at: o("string"),
  limits: r({
    object: {
      max_frame_bytes: r("int"),
      max_inflight: r("int"),
      max_chunk_bytes: r("int"),
      max_output_bytes: r("int"),
    },
  }),
};
const errorSchema: Schema = { code: r("string"), message: r("string"), request_id: o("string") };

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function checkValue(k: Kind, v: unknown, where: string, strict = true): unknown {
  const bad = (want: string) => new ProtocolError(`${where}: want ${want}, got ${JSON.stringify(v)}`);
  if (typeof k === "object") {
    if ("object" in k) {
      if (!isObject(v)) throw bad("an object");
      return decodeWith(k.object, v, where, strict);
    }
    if (v === null && k.nullable) return null;
    if (!Array.isArray(v)) throw bad("an array");
    return v.map((item, i) => {
      if (!isObject(item)) throw new ProtocolError(`${where}[${i}]: want an object`);
      return decodeWith(k.array, item, `${where}[${i}]`, strict);
    });
  }
  switch (k) {
    case "string":
      if (typeof v !== "string") throw bad("a string");
      return v;
    case "bool":
      if (typeof v !== "boolean") throw bad("a boolean");
      return v;
    case "int":
      if (typeof v !== "number" || !Number.isSafeInteger(v)) throw bad("an integer");
      return v;
    case "uint32":
      if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > 0xffffffff) throw bad("a uint32");
      return v;
    case "string[]":
      if (!Array.isArray(v) || v.some((s) => typeof s !== "string")) throw bad("an array of strings");
      return [...v];
    case "string-map":
      if (!isObject(v) || Object.values(v).some((s) => typeof s !== "string")) throw bad("an object of strings");
      return { ...v };
  }
}

/** Keeps the schema's keys of v, checked; unknown keys are refused when strict, else dropped. */
function decodeWith(schema: Schema, v: Record<string, unknown>, where: string, strict: boolean): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  if (strict) {
    for (const key of Object.keys(v)) {
      if (!(key in schema)) throw new ProtocolError(`${where}: unknown field "${key}"`);
    }
  }
  for (const [key, f] of Object.entries(schema)) {
    if (!(key in v) || v[key] === undefined) {
      if (f.req) throw new ProtocolError(`${where}: missing field "${key}"`);
      continue;
    }
    out[key] = checkValue(f.k, v[key], `${where}.${key}`, strict);
  }
  return out;
}

/** Writes the keys of v that the schema knows and that are set, in the schema's order. */
function encodeWith(schema: Schema, v: Record<string, unknown>, where: string): Record<string, unknown> {
  for (const key of Object.keys(v)) {
    if (!(key in schema) && v[key] !== undefined) throw new ProtocolError(`${where}: unknown field "${key}"`);
  }
  const out: Record<string, unknown> = {};
  for (const [key, f] of Object.entries(schema)) {
    const x = v[key];
    if (x === undefined) {
      if (f.req) throw new ProtocolError(`${where}: missing field "${key}"`);
      continue;
    }
    checkValue(f.k, x, `${where}.${key}`);
    if (typeof f.k === "object" && "object" in f.k) out[key] = encodeWith(f.k.object, x as Record<string, unknown>, `${where}.${key}`);
    else if (typeof f.k === "object" && "array" in f.k && Array.isArray(x)) {
      const sub = f.k.array;
      out[key] = x.map((item, i) => encodeWith(sub, item as Record<string, unknown>, `${where}.${key}[${i}]`));
    } else out[key] = x;
  }
  return out;
}

const argless = new Set(["ping", "env", "cancel"]);

function isOp(op: string): op is Op {
  return op === "ping" || op === "env" || op in argSchemas;
}

/** Decodes a client text frame (a request or a cancel), strictly. */
export function decodeClientFrame(text: string): ClientFrame {
  const v: unknown = JSON.parse(text);
  if (!isObject(v)) throw new ProtocolError("a request is a JSON object");
  for (const key of Object.keys(v)) {
    if (key !== "id" && key !== "op" && key !== "args") throw new ProtocolError(`request: unknown field "${key}"`);
  }
  const id = checkValue("uint32", v.id, "request.id") as number;
  const op = checkValue("string", v.op, "request.op") as string;
  if (op === "cancel") {
    if (v.args !== undefined) throw new ProtocolError("cancel takes no args");
    return { id, op };
  }
  if (!isOp(op)) throw new ProtocolError(`unknown op "${op}"`);
  if (argless.has(op)) {
    if (v.args !== undefined) throw new ProtocolError(`${op} takes no args`);
    return { id, op } as ClientFrame;
  }
  if (v.args === undefined) return { id, op } as ClientFrame;
  if (!isObject(v.args)) throw new ProtocolError("request.args: want an object");
  const schema = argSchemas[op as keyof typeof argSchemas];
  return { id, op, args: decodeWith(schema, v.args, `${op}.args`, true) } as ClientFrame;
}

/** Encodes a client text frame; args are checked against the op's schema (typos never leave). */
export function encodeClientFrame(f: ClientFrame): string {
  checkValue("uint32", f.id, "request.id");
  const out: Record<string, unknown> = { id: f.id, op: f.op };
  const args = (f as { args?: unknown }).args;
  if (argless.has(f.op)) {
    if (args !== undefined) throw new ProtocolError(`${f.op} takes no args`);
  } else if (args !== undefined) {
    if (!isOp(f.op)) throw new ProtocolError(`unknown op "${f.op}"`);
    out.args = encodeWith(argSchemas[f.op as keyof typeof argSchemas], args as Record<string, unknown>, `${f.op}.args`);
  }
  return JSON.stringify(out);
}

/**
 * Decodes a server text frame's envelope. A result stays raw until decodeResult (its op says how).
 * Unknown keys are dropped unless strict (the golden-frame tests).
 */
export function decodeServerFrame(text: string, strict = false): ServerFrame {
  const v: unknown = JSON.parse(text);
  if (!isObject(v)) throw new ProtocolError("a server frame is a JSON object");
  if (strict) {
    for (const key of Object.keys(v)) {
      if (!["id", "type", "hello", "result", "error"].includes(key)) throw new ProtocolError(`frame: unknown field "${key}"`);
    }
  }
  const id = checkValue("uint32", v.id, "frame.id") as number;
  if (v.type !== undefined || v.hello !== undefined) {
    if (v.type !== "hello" || !isObject(v.hello)) throw new ProtocolError(`frame: unknown type ${JSON.stringify(v.type)}`);
    return { id, type: "hello", hello: decodeWith(helloSchema, v.hello, "hello", strict) as unknown as Hello };
  }
  if (v.error !== undefined) {
    if (v.result !== undefined) throw new ProtocolError("frame: both result and error");
    if (!isObject(v.error)) throw new ProtocolError("frame.error: want an object");
    return { id, error: decodeWith(errorSchema, v.error, "error", strict) as unknown as WireError };
  }
  if (v.result === undefined) throw new ProtocolError("frame: neither result, error nor hello");
  return { id, result: v.result };
}

/** Encodes a server text frame (tests; the broker is the real server). */
export function encodeServerFrame(f: ServerFrame, kind?: ResultKind): string {
  if ("hello" in f) return JSON.stringify({ id: f.id, type: "hello", hello: encodeWith(helloSchema, f.hello as never, "hello") });
  if ("error" in f) return JSON.stringify({ id: f.id, error: encodeWith(errorSchema, f.error as never, "error") });
  return JSON.stringify({ id: f.id, result: kind ? encodeResult(kind, f.result) : f.result });
}

/** Decodes and checks a result of the given kind. Unknown keys are dropped unless strict. */
export function decodeResult<K extends ResultKind>(kind: K, raw: unknown, strict = false): unknown {
  if (!isObject(raw)) throw new ProtocolError(`${kind} result: want an object`);
  return decodeWith(resultSchemas[kind], raw, `${kind} result`, strict);
}

/** Encodes a result of the given kind. */
export function encodeResult(kind: ResultKind, v: unknown): Record<string, unknown> {
  if (!isObject(v)) throw new ProtocolError(`${kind} result: want an object`);
  return encodeWith(resultSchemas[kind], v, `${kind} result`);
}

// ---- Binary frames ----

export interface BinaryFrame {
  kind: number;
  id: number;
  payload: Buffer;
}

/** Builds a binary frame: the 5-byte header, then the payload. */
export function encodeBinaryFrame(kind: number, id: number, payload?: Uint8Array): Buffer {
  const b = Buffer.allocUnsafe(FRAME_HEADER_LEN + (payload?.length ?? 0));
  b[0] = kind;
  b.writeUInt32BE(id >>> 0, 1);
  if (payload) b.set(payload, FRAME_HEADER_LEN);
  return b;
}

/** Splits a binary frame into kind, request id and payload (a view, not a copy). */
export function parseBinaryFrame(b: Buffer): BinaryFrame {
  if (b.length < FRAME_HEADER_LEN) throw new ProtocolError("binary frame shorter than its 5-byte header");
  return { kind: b[0]!, id: b.readUInt32BE(1), payload: b.subarray(FRAME_HEADER_LEN) };
}

// ---- Frames with a body ----

export interface BodyFrame {
  kind: number;
  id: number;
  /** The request's or answer's JSON text. */
  json: string;
  /** The body: a view of the frame, not a copy. */
  body: Buffer;
}

/** Builds a frame with a body (kinds 5, 6): header, JSON length, JSON, body. */
export function encodeBodyFrame(kind: number, id: number, json: string, body?: Uint8Array): Buffer {
  const jsLen = Buffer.byteLength(json);
  const b = Buffer.allocUnsafe(BODY_HEADER_LEN + jsLen + (body?.length ?? 0));
  b[0] = kind;
  b.writeUInt32BE(id >>> 0, 1);
  b.writeUInt32BE(jsLen, FRAME_HEADER_LEN);
  b.write(json, BODY_HEADER_LEN, "utf8");
  if (body) b.set(body, BODY_HEADER_LEN + jsLen);
  return b;
}

/** Splits a frame with a body; a JSON length past the frame's end is refused. */
export function parseBodyFrame(b: Buffer): BodyFrame {
  if (b.length < BODY_HEADER_LEN) throw new ProtocolError("a frame with a body is shorter than its 9-byte header");
  const jsLen = b.readUInt32BE(FRAME_HEADER_LEN);
  if (jsLen > b.length - BODY_HEADER_LEN) throw new ProtocolError("a frame with a body says its JSON passes the frame's end");
  return {
    kind: b[0]!,
    id: b.readUInt32BE(1),
    json: b.toString("utf8", BODY_HEADER_LEN, BODY_HEADER_LEN + jsLen),
    body: b.subarray(BODY_HEADER_LEN + jsLen),
  };
}

/** The ReadResult a read's head and raw content make: content that is not UTF-8 comes base64-encoded, as the Go backends answer. */
export function readResultOf(head: ReadHead, body: Buffer): ReadResult {
  return isUtf8(body)
    ? { ...head, content: body.toString("utf8"), encoding: "utf-8" }
    : { ...head, content: body.toString("base64"), encoding: "base64" };
}

const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/** Splits a write into its wire args and its body (base64 content decoded); bad base64 or an unknown encoding is refused. */
export function writeBodyOf(a: WriteArgs): { head: WriteHead; body: Buffer } {
  const head: WriteHead = a.mode !== undefined ? { path: a.path, mode: a.mode } : { path: a.path };
  switch (a.encoding) {
    case undefined:
    case "utf-8":
      return { head, body: Buffer.from(a.content, "utf8") };
    case "base64":
      if (!BASE64.test(a.content)) throw new ProtocolError("content is not valid base64");
      return { head, body: Buffer.from(a.content, "base64") };
  }
  throw new ProtocolError(`unknown encoding ${JSON.stringify(a.encoding)}; use "utf-8" or "base64"`);
}
