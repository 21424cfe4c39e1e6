// A deepagents sandbox backend (SandboxBackendProtocolV2) on the broker's dataplane. Every operation
// is one native dataplane request (ls -> ls, read_file -> read with a line window, grep -> literal
// grep, ...), not a process started through execute as deepagents' BaseSandbox does. Failures come
// back as {error: sentence} values (execute: as its output): a thrown error would abort the run.

import type {
  DeleteResult,
  EditResult,
  ExecuteResponse,
  FileDownloadResponse,
  FileInfo,
  FileOperationError,
  FileUploadResponse,
  GlobResult,
  GrepResult,
  LsResult,
  ReadRawResult,
  ReadResult,
  SandboxBackendProtocolV2,
  WriteResult,
} from "deepagents";
import { createHash } from "node:crypto";
import { getConfig } from "@langchain/langgraph";
import { DataplaneClient, type CallOptions, type DataplaneOptions } from "./dataplane.js";
import { DataplaneError, asDataplaneError, describeForModel, isCredentialRefusal } from "./errors.js";
import { ErrorCode, type FileInfo as WireFileInfo, type WriteResult as WireWriteResult } from "./protocol.js";
import type { SandboxBlock } from "./runconfig.js";
import { downloadBatch, tarFiles, workspaceName, type BatchItem } from "./trees.js";

/** The sandbox's workspace: file tools work inside it, and commands start in it. */
export const WORKSPACE = "/workspace";

/**
 * The id shown while the sandbox id is unknown (no valid block in reach, or not yet connected):
 * non-empty, so deepagents keeps the execute tool.
 */
export const UNCONFIGURED_ID = "sbx-broker";

/**
 * When a credential expires (ms since the epoch), if it says so: a JWT's exp claim, read without
 * verifying it (the broker verifies every token); undefined for anything else.
 */
export function credentialExpiry(credential: string): number | undefined {
  const parts = credential.split(".");
  if (parts.length !== 3) return undefined;
  try {
    const claims = JSON.parse(Buffer.from(parts[1]!, "base64url").toString("utf8")) as { exp?: unknown };
    return typeof claims.exp === "number" && Number.isFinite(claims.exp) ? claims.exp * 1000 : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The refusal of a block whose credential has expired, or undefined. Agent servers keep a run's
 * config in thread state, so a later run without a block inherits the old one: it is refused here,
 * before anything is dialled, with a sentence that asks for a fresh block.
 */
export function expiredBlock(block: SandboxBlock, now = Date.now()): DataplaneError | undefined {
  const exp = credentialExpiry(block.credential);
  if (exp === undefined || exp > now) return undefined;
  return new DataplaneError(
    ErrorCode.TokenExpired,
    `the run config's sandbox credential expired at ${new Date(exp).toISOString()}; send a fresh run config (sbctl run-config) with this run`,
  );
}

/** Where deepagents saves tool answers too large for the model's context. */
const LARGE_RESULTS = "/large_tool_results/";

/** What deepagents' read_file shows for an empty file (its EMPTY_CONTENT_WARNING). */
export const EMPTY_CONTENT_WARNING = "System reminder: File exists but has empty contents";

// The broker caps grep answers at 1000 matches (its default and maximum).
const GREP_MAX = 1000;
// Room for the JSON envelope around a write's content when choosing between write and upload.
const FRAME_SLACK = 4 << 10;
const DEFAULT_MAX_FRAME = 1114112;
// A non-streamed exec answer carries all its output in one frame: with JSON escaping (up to six
// bytes per control byte) 8 MiB stays within the client's 64 MiB frame limit.
const MAX_EXEC_OUTPUT = 8 << 20;

/** Tuning of the backend's commands. */
export interface BrokerSandboxOptions {
  /** Per-command timeout in ms (default: the sandbox's, 10 min; capped by the broker at 1 h). */
  execTimeoutMs?: number;
  /**
   * Output cap of a command in bytes (default: the broker's, 1 MiB; at most 8 MiB, since the output
   * travels in one frame); past it output is dropped and the result says truncated.
   */
  maxOutputBytes?: number;
  /**
   * The signal that cancels a call (default: the current LangGraph run's, getConfig().signal), so
   * that a cancelled run cancels its requests on the broker: a running command's process tree is
   * killed, an upload discarded.
   */
  signal?: () => AbortSignal | undefined;
}

function runSignal(): AbortSignal | undefined {
  try {
    return getConfig()?.signal;
  } catch {
    return undefined; // outside a run
  }
}

/**
 * Maps a path a model gives to a sandbox path. deepagents' tools default to "/" and keep their own
 * files under absolute paths (/large_tool_results/...), so the workspace is the agent's root:
 * "/" and "" are /workspace, /workspace/... is itself, any other absolute path is taken inside the
 * workspace (/notes.md -> /workspace/notes.md), and a relative path is left for the broker, which
 * resolves it against /workspace. Nothing can name a file outside the workspace.
 */
export function toSandboxPath(p: string | null | undefined): string {
  if (p === undefined || p === null || p === "" || p === "/") return WORKSPACE;
  if (p === WORKSPACE || p.startsWith(`${WORKSPACE}/`)) return p;
  if (p.startsWith("/")) return `${WORKSPACE}${p}`;
  return p;
}

/**
 * Whether answers to a call that named path should use the agent's view, where the workspace is /
 * (true), or sandbox paths (false): a path the agent wrote as /workspace/... is answered as such,
 * anything else ("/notes.md", "/", a relative path, none) in the agent's view.
 */
function agentView(path: string | null | undefined): boolean {
  return !(path === WORKSPACE || (typeof path === "string" && path.startsWith(`${WORKSPACE}/`)));
}

/** A sandbox path as the agent sees it: /workspace is /, /workspace/x is /x; anything else as is. */
export function toAgentPath(p: string): string {
  if (p === WORKSPACE || p === `${WORKSPACE}/`) return "/";
  if (p.startsWith(`${WORKSPACE}/`)) return p.slice(WORKSPACE.length);
  return p;
}

// A /workspace path inside a sentence (an error message), not part of a longer name.
const WORKSPACE_IN_TEXT = /(?<![\w./-])\/workspace(?:\/|(?![\w/-]|\.\w))/g;

/** A sentence with its sandbox paths in the agent's view. */
function toAgentText(text: string): string {
  return text.replace(WORKSPACE_IN_TEXT, "/");
}

// deepagents decides text or binary by extension (its getMimeType / isTextMimeType, not exported).
const BINARY_TYPES: Record<string, string> = {
  ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp",
  ".heic": "image/heic", ".heif": "image/heif", ".mp3": "audio/mpeg", ".wav": "audio/wav", ".aiff": "audio/aiff",
  ".aac": "audio/aac", ".ogg": "audio/ogg", ".flac": "audio/flac", ".mp4": "video/mp4", ".webm": "video/webm",
  ".mpeg": "video/mpeg", ".mov": "video/quicktime", ".avi": "video/x-msvideo", ".flv": "video/x-flv",
  ".mpg": "video/mpeg", ".wmv": "video/x-ms-wmv", ".3gpp": "video/3gpp", ".pdf": "application/pdf",
  ".ppt": "application/vnd.ms-powerpoint",
  ".pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
};
const TEXT_TYPES: Record<string, string> = {
  ".svg": "image/svg+xml", ".md": "text/markdown", ".markdown": "text/markdown", ".html": "text/html", ".htm": "text/html",
  ".css": "text/css", ".csv": "text/csv", ".xml": "text/xml", ".json": "application/json", ".js": "application/javascript",
  ".mjs": "application/javascript", ".cjs": "application/javascript",
};

/** The MIME type deepagents would give this path. */
export function mimeTypeOf(path: string): string {
  const base = path.slice(path.lastIndexOf("/") + 1);
  const dot = base.lastIndexOf(".");
  const ext = dot <= 0 ? "" : base.slice(dot).toLowerCase();
  return BINARY_TYPES[ext] ?? TEXT_TYPES[ext] ?? "text/plain";
}

/** Whether deepagents treats this MIME type as text. */
export function isTextMimeType(m: string): boolean {
  return m.startsWith("text/") || m === "application/json" || m === "application/javascript" || m === "image/svg+xml";
}

const BASE64 = /^[A-Za-z0-9+/\s]*={0,2}\s*$/;

function toInfo(f: WireFileInfo, view: boolean): FileInfo {
  const dir = f.type === "dir";
  const path = view ? toAgentPath(f.path) : f.path;
  return { path: dir && path !== "/" ? `${path}/` : path, is_dir: dir, size: dir ? 0 : f.size, modified_at: f.mod_time };
}

/** deepagents' per-file error codes are a closed set; each dataplane code goes to the nearest. */
function fileOperationError(err: unknown): FileOperationError {
  const e = asDataplaneError(err);
  if (isCredentialRefusal(e)) return "permission_denied";
  switch (e.code) {
    case ErrorCode.FileNotFound:
      return "file_not_found";
    case ErrorCode.IsDirectory:
      return "is_directory";
    case ErrorCode.PermissionDenied:
    case ErrorCode.ScopeDenied:
    case ErrorCode.Unauthenticated:
    case ErrorCode.Forbidden:
    case ErrorCode.InvalidRunConfig:
      return "permission_denied";
    default:
      return "invalid_path";
  }
}

/**
 * One sandbox as a deepagents backend. Safe for concurrent calls (deepagents runs parallel tool
 * calls at once): they share the client's one connection, each with its own request id.
 */
export class BrokerSandbox implements SandboxBackendProtocolV2 {
  constructor(
    readonly client: DataplaneClient,
    private readonly opts: BrokerSandboxOptions = {},
  ) {}

  /** The sandbox id (the hello's once connected): deepagents shows the execute tool only when this is non-empty. */
  get id(): string {
    return this.client.sandboxId || UNCONFIGURED_ID;
  }

  /** A backend whose every call answers with err, in each operation's usual failure shape. */
  static failing(err: DataplaneError): BrokerSandbox {
    return new BrokerSandbox(DataplaneClient.failing(err));
  }

  /**
   * The backend for the sandbox a run-config block names, from the process-wide pool (defaultPool):
   * the same block (and options) gives the same backend and so one WebSocket, however often it is
   * called, so a deepagents factory (`backend: () => BrokerSandbox.fromBlock(...)`, called at every
   * tool call) keeps one connection per sandbox. Connects on first use. close() closes it for
   * every holder; a backend the broker closed for good is replaced at the next call.
   */
  static fromBlock(block: SandboxBlock, opts?: BrokerSandboxOptions & PoolDialOptions): BrokerSandbox {
    return defaultPool.get(block, opts);
  }

  /** A backend with a connection of its own (not pooled): close() it when done. */
  static dedicated(block: SandboxBlock, opts: BrokerSandboxOptions & PoolDialOptions = {}): BrokerSandbox {
    const expired = expiredBlock(block);
    if (expired) return BrokerSandbox.failing(expired);
    const client = new DataplaneClient({ ...opts, url: block.dataplane_url, credential: block.credential, sandboxId: block.sandbox_id });
    return new BrokerSandbox(client, opts);
  }

  /** Connects now (a bad credential fails here rather than in the first tool call). */
  static async connect(o: DataplaneOptions & BrokerSandboxOptions): Promise<BrokerSandbox> {
    const client = new DataplaneClient(o);
    await client.connect();
    return new BrokerSandbox(client, o);
  }

  /** Closes the connection. */
  close(): void {
    this.client.close();
  }

  /** Per-call options: the current run's abort signal. */
  private call(): CallOptions {
    return { signal: (this.opts.signal ?? runSignal)() };
  }

  /** The sentence a model reads for err, in the view of the path the call named. */
  private describe(err: unknown, path?: string | null): string {
    const s = describeForModel(err, { path: path ?? undefined, allowCmd: this.client.hello?.allow_cmd });
    return agentView(path) ? toAgentText(s) : s;
  }

  /** A result path in the view of the path the call named. */
  private answerPath(p: string, asked: string | null | undefined): string {
    return agentView(asked) ? toAgentPath(p) : p;
  }

  /**
   * Replaces a file with text (a string) or bytes: one write request when it fits in a frame (bytes
   * travel base64), else an upload streamed in chunks.
   */
  private put(path: string, data: string | Uint8Array): Promise<WireWriteResult> {
    const text = typeof data === "string";
    const encodedSize = text ? Buffer.byteLength(JSON.stringify(data)) : Math.ceil(data.length / 3) * 4;
    const limit = this.client.hello?.limits.max_frame_bytes ?? DEFAULT_MAX_FRAME;
    if (encodedSize + FRAME_SLACK > limit) return this.client.upload(path, text ? Buffer.from(data, "utf8") : data, this.call());
    const args = text ? { path, content: data } : { path, content: Buffer.from(data).toString("base64"), encoding: "base64" as const };
    return this.client.write(args, this.call());
  }

  async ls(path: string): Promise<LsResult> {
    try {
      const r = await this.client.ls(toSandboxPath(path), this.call());
      const view = agentView(path);
      return { files: (r.entries ?? []).map((f) => toInfo(f, view)) };
    } catch (e) {
      return { error: this.describe(e, path) };
    }
  }

  /** A window of lines (offset 0-based, limit lines), as deepagents' read_file pages through files. */
  async read(filePath: string, offset = 0, limit = 500): Promise<ReadResult> {
    const mimeType = mimeTypeOf(filePath);
    try {
      const p = toSandboxPath(filePath);
      if (!isTextMimeType(mimeType)) {
        return { content: new Uint8Array(await this.client.download(p, this.call())), mimeType };
      }
      const off = Number.isFinite(offset) ? Math.max(0, Math.floor(offset)) : 0;
      const lim = Number.isFinite(limit) ? Math.max(0, Math.floor(limit)) : 0;
      if (lim === 0) return { content: "", mimeType };
      const r = await this.client.read({ path: p, line_offset: off, line_limit: lim }, this.call());
      if (r.size === 0) return { content: EMPTY_CONTENT_WARNING, mimeType };
      const total = r.total_lines ?? 0;
      if (off >= total) return { error: `Line offset ${off} exceeds file length (${total} lines)` };
      // Content that is not valid UTF-8 comes base64-encoded; a text tool shows it lossily.
      let text = r.encoding === "base64" ? Buffer.from(r.content, "base64").toString("utf8") : r.content;
      // Cut at the broker's size cap: a partial last line is left for the next page, unless it is
      // the only line (longer than the cap), whose start is all there is to show.
      const midLine = r.truncated === true && !text.includes("\n");
      if (r.truncated && !midLine) text = text.slice(0, text.lastIndexOf("\n") + 1);
      if (text.endsWith("\n")) text = text.slice(0, -1);
      const n = text === "" ? 1 : text.split("\n").length;
      const endLine = Math.min(off + n, total);
      // A partial count (the broker scans at most 64 MiB for a line window) is a lower bound.
      const next = endLine < total || r.total_lines_partial === true ? endLine : undefined;
      if (midLine) text += `\n[Line ${endLine} is longer than the broker's read limit and was cut; use execute (e.g. head -c) to see the rest of it.]`;
      else if (r.truncated) text += `\n[The broker cut this read at its size limit; read on from offset ${endLine}.]`;
      return { content: text, mimeType, totalLines: total, startLine: off + 1, endLine, nextOffset: next };
    } catch (e) {
      return { error: this.describe(e, filePath) };
    }
  }

  async readRaw(filePath: string): Promise<ReadRawResult> {
    try {
      const p = toSandboxPath(filePath);
      const [info, bytes] = await Promise.all([this.client.stat(p, this.call()), this.client.download(p, this.call())]);
      const mimeType = mimeTypeOf(filePath);
      return {
        data: {
          content: isTextMimeType(mimeType) ? bytes.toString("utf8") : new Uint8Array(bytes),
          mimeType,
          created_at: info.mod_time,
          modified_at: info.mod_time,
        },
      };
    } catch (e) {
      return { error: this.describe(e, filePath) };
    }
  }

  /** Creates or replaces a file. Content for binary types (.png, .pdf, ...) is base64, as in deepagents. */
  async write(filePath: string, content: string): Promise<WriteResult> {
    if (filePath.startsWith(LARGE_RESULTS)) return this.saveLargeResult(filePath, content);
    try {
      const p = toSandboxPath(filePath);
      const binary = !isTextMimeType(mimeTypeOf(filePath));
      if (binary && !BASE64.test(content)) {
        return { error: `Content for ${filePath} must be base64: its type is binary (${mimeTypeOf(filePath)}).` };
      }
      const w = await this.put(p, binary ? Buffer.from(content, "base64") : content);
      return { path: this.answerPath(w.path, filePath), filesUpdate: null };
    } catch (e) {
      return { error: this.describe(e, filePath) };
    }
  }

  /**
   * deepagents saves a tool answer too large for the model's context (a long command output) under
   * /large_tool_results/ and shows the model a preview; when the save fails it shows only the
   * error. So a save that cannot happen (no fs:write scope) or fails answers with an error that
   * says why and carries the whole output, which the model then reads instead of losing it.
   */
  private async saveLargeResult(filePath: string, content: string): Promise<WriteResult> {
    const kept = `\nThe output was not saved in the sandbox, so here it is in full:\n\n${content}`;
    const scopes = this.client.hello?.scopes;
    if (scopes && !scopes.includes("fs:write")) {
      return { error: `this run's sandbox credential has no fs:write scope.${kept}` };
    }
    try {
      const w = await this.put(toSandboxPath(filePath), content);
      return { path: this.answerPath(w.path, filePath), filesUpdate: null };
    } catch (e) {
      return { error: `${this.describe(e, filePath)}${kept}` };
    }
  }

  async edit(filePath: string, oldString: string, newString: string, replaceAll = false): Promise<EditResult> {
    try {
      const p = toSandboxPath(filePath);
      if (oldString === "") {
        // deepagents' convention: an empty old string sets the content of an empty file.
        const info = await this.client.stat(p, this.call());
        // deepagents reports 0 replacements here: nothing was replaced, the content was set.
        if (info.size !== 0) return { error: "Error: oldString cannot be empty when file has content" };
        if (newString === "") return { path: this.answerPath(info.path, filePath), filesUpdate: null, occurrences: 0 };
        const w = await this.put(p, newString);
        return { path: this.answerPath(w.path, filePath), filesUpdate: null, occurrences: 0 };
      }
      if (oldString === newString) return { error: "Error: old_string and new_string are identical; nothing to replace." };
      const r = await this.client.edit({ path: p, old: oldString, new: newString, replace_all: replaceAll || undefined }, this.call());
      return { path: this.answerPath(r.path, filePath), filesUpdate: null, occurrences: r.occurrences };
    } catch (e) {
      return { error: this.describe(e, filePath) };
    }
  }

  /** Literal search (not a regex), as deepagents' grep tool promises. */
  async grep(pattern: string, path?: string | null, glob?: string | null, maxCount?: number | null): Promise<GrepResult> {
    try {
      const max = maxCount === undefined || maxCount === null ? undefined : Math.min(Math.max(1, Math.floor(maxCount)), GREP_MAX);
      const r = await this.client.grep({ pattern, path: toSandboxPath(path), glob: glob || undefined, max_count: max }, this.call());
      const view = agentView(path);
      const matches = (r.matches ?? []).map((m) => (view ? { ...m, path: toAgentPath(m.path) } : m));
      return { matches, truncated: r.truncated || undefined };
    } catch (e) {
      return { error: this.describe(e, path) };
    }
  }

  async glob(pattern: string, path?: string): Promise<GlobResult> {
    try {
      let base = toSandboxPath(path);
      let pat = pattern;
      let view = agentView(path);
      // A pattern given as an absolute path is relative to the root it names.
      if (pat.startsWith(`${WORKSPACE}/`)) {
        pat = pat.slice(WORKSPACE.length + 1);
        base = WORKSPACE;
        view = false;
      } else if (pat.startsWith("/")) {
        pat = pat.replace(/^\/+/, "");
        base = WORKSPACE;
        view = true;
      }
      const r = await this.client.glob({ pattern: pat, path: base }, this.call());
      return { files: (r.files ?? []).map((f) => toInfo(f, view)), truncated: r.truncated || undefined };
    } catch (e) {
      return { error: this.describe(e, path) };
    }
  }

  /** Deletes a file, or a directory with everything in it. */
  async delete(filePath: string): Promise<DeleteResult> {
    try {
      const r = await this.client.delete({ path: toSandboxPath(filePath), recursive: true }, this.call());
      return { path: this.answerPath(r.path, filePath), filesUpdate: null };
    } catch (e) {
      return { error: this.describe(e, filePath) };
    }
  }

  /**
   * Runs a /bin/sh -c command in the workspace; stdout and stderr are combined as written. The
   * output streams as bytes and is decoded here as deepagents' own backends decode theirs (Node's
   * UTF-8 decoder: one U+FFFD per invalid byte), and it stays out of the broker's budget for
   * buffered answers.
   */
  async execute(command: string): Promise<ExecuteResponse> {
    try {
      const decoder = new TextDecoder("utf-8");
      let output = "";
      const r = await this.client.exec({
        command,
        combined: true,
        timeout_ms: this.opts.execTimeoutMs,
        max_output: this.opts.maxOutputBytes === undefined ? undefined : Math.min(this.opts.maxOutputBytes, MAX_EXEC_OUTPUT),
      }, { ...this.call(), onStdout: (chunk) => (output += decoder.decode(chunk, { stream: true })) });
      output += decoder.decode();
      if (r.reason === "timeout") output += "\n[The broker killed the command: it ran past its timeout.]";
      else if (r.reason === "memory_limit") output += "\n[The command was killed: the sandbox's memory limit was reached.]";
      else if (r.signal) output += `\n[The command was killed by signal ${r.signal}.]`;
      return { output, exitCode: r.exit_code, truncated: r.truncated === true };
    } catch (e) {
      // Nothing ran (refused, or the broker is out of reach): no exit code.
      return { output: `Error: ${this.describe(e)}`, exitCode: null, truncated: false };
    }
  }

  /**
   * Writes files into the workspace: every file under /workspace in one tar stream (one round
   * trip, the dataplane's untar); anything else, or all of them again one by one when the tar is
   * refused, through uploads, so that each file gets its own answer.
   */
  async uploadFiles(files: Array<[string, Uint8Array]>): Promise<FileUploadResponse[]> {
    if (files.length > 1) {
      const named = files.map(([path, content]) => [workspaceName(toSandboxPath(path)), content] as const);
      if (named.every(([n]) => n !== null)) {
        try {
          await this.client.untar(WORKSPACE, tarFiles(named as Array<[string, Uint8Array]>), this.call());
          return files.map(([path]) => ({ path, error: null }));
        } catch {
          // One by one below: each file's own error.
        }
      }
    }
    return Promise.all(
      files.map(async ([path, content]): Promise<FileUploadResponse> => {
        try {
          await this.put(toSandboxPath(path), content);
          return { path, error: null };
        } catch (e) {
          return { path, error: fileOperationError(e) };
        }
      }),
    );
  }

  /**
   * Reads files from the workspace: every file under /workspace in one tar stream (one round trip,
   * the dataplane's tar with paths), each with its own answer (its bytes, or the error a download of
   * it would give); anything else, or all of them again one by one when the batch fails (a broker
   * without tar paths, a stream refused), through downloads.
   */
  async downloadFiles(paths: string[]): Promise<FileDownloadResponse[]> {
    const names = paths.map((p) => workspaceName(toSandboxPath(p)));
    const unique = [...new Set(names.filter((n): n is string => n !== null))];
    let batch: Map<string, BatchItem> | undefined;
    if (unique.length > 1) {
      try {
        batch = await downloadBatch(this.client, WORKSPACE, unique, this.call());
      } catch {
        // One by one below: each file's own answer.
      }
    }
    return Promise.all(
      paths.map(async (path, i): Promise<FileDownloadResponse> => {
        const name = names[i];
        const got = name === null || name === undefined ? undefined : batch?.get(name);
        if (got) {
          // A copy for each path, as a download gives: a path asked twice gets two.
          if ("content" in got) return { path, content: new Uint8Array(got.content), error: null };
          return { path, content: null, error: fileOperationError(got.error) };
        }
        try {
          return { path, content: new Uint8Array(await this.client.download(toSandboxPath(path), this.call())), error: null };
        } catch (e) {
          return { path, content: null, error: fileOperationError(e) };
        }
      }),
    );
  }
}

/** Dial tuning of a pooled backend (URL, credential and sandbox id come from each block). */
export type PoolDialOptions = Omit<DataplaneOptions, "url" | "credential" | "sandboxId">;

// Options are part of a pooled backend's key; a function (a signal source) counts by identity.
const functionIds = new WeakMap<object, number>();
let nextFunctionId = 0;
function optionsKey(opts: object | undefined): string {
  if (!opts) return "";
  const entries = Object.entries(opts)
    .filter(([, v]) => v !== undefined)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))
    .map(([k, v]) => {
      if (typeof v !== "function") return [k, v];
      let id = functionIds.get(v);
      if (id === undefined) functionIds.set(v, (id = ++nextFunctionId));
      return [k, `function#${id}`];
    });
  return JSON.stringify(entries);
}

/** Options of a pool's connections. */
export interface SandboxPoolOptions {
  /** Most connections kept open; the least recently used beyond it are closed (default 64). */
  maxConnections?: number;
  /** A connection unused for this long is closed (default 10 min); the next call re-dials. */
  idleMs?: number;
  /** Dial tuning (URL, credential and sandbox id come from each block). */
  dial?: PoolDialOptions;
  /** Command tuning of every backend. */
  sandbox?: BrokerSandboxOptions;
}

/**
 * Backends keyed by dataplane URL, sandbox id and credential: one connection each. A backend whose
 * connection the broker closed for good (revoked, expired, sandbox stopped) is dropped, so the next
 * run with a fresh block, or after the owner resumed the sandbox, dials again.
 */
export class SandboxPool {
  private readonly entries = new Map<string, BrokerSandbox>();
  private readonly max: number;
  private readonly idleMs: number;
  private sweeper?: NodeJS.Timeout;

  constructor(private readonly o: SandboxPoolOptions = {}) {
    this.max = Math.max(1, o.maxConnections ?? 64);
    this.idleMs = o.idleMs ?? 10 * 60_000;
  }

  private static keyOf(b: SandboxBlock, opts?: BrokerSandboxOptions & PoolDialOptions): string {
    const cred = createHash("sha256").update(b.credential).digest("base64url");
    return `${b.dataplane_url}\n${b.sandbox_id}\n${cred}\n${optionsKey(opts)}`;
  }

  /**
   * The backend for a block, created (not yet connected) on first use; opts, when given, tune it
   * over the pool's options, and a block with other options is another backend.
   */
  get(block: SandboxBlock, opts?: BrokerSandboxOptions & PoolDialOptions): BrokerSandbox {
    const key = SandboxPool.keyOf(block, opts);
    let sb = this.entries.get(key);
    const expired = expiredBlock(block);
    if (expired) {
      // Refused before dialling; a connection it still has closes now.
      if (sb) {
        this.entries.delete(key);
        sb.close();
      }
      return BrokerSandbox.failing(expired);
    }
    if (sb && sb.client.finished) {
      this.entries.delete(key);
      sb = undefined;
    }
    if (sb) {
      // Most recently used last: Map order is the eviction order.
      this.entries.delete(key);
      this.entries.set(key, sb);
      return sb;
    }
    const created = BrokerSandbox.dedicated(block, { ...this.o.dial, ...this.o.sandbox, ...opts });
    created.client.onEnded = () => {
      if (this.entries.get(key) === created) this.entries.delete(key);
      created.close();
    };
    this.entries.set(key, created);
    // Over the cap: close the least recently used connections with no call under way, dialling
    // included (a busy pool may stay over the cap until its calls end).
    for (const [k, sb] of this.entries) {
      if (this.entries.size <= this.max) break;
      if (sb !== created && sb.client.inflight === 0) {
        this.entries.delete(k);
        sb.close();
      }
    }
    this.startSweeper();
    return created;
  }

  private startSweeper(): void {
    if (this.sweeper) return;
    this.sweeper = setInterval(() => {
      const cutoff = Date.now() - this.idleMs;
      for (const [key, sb] of this.entries) {
        if (sb.client.lastUsed < cutoff && sb.client.inflight === 0) {
          this.entries.delete(key);
          sb.close();
        }
      }
    }, Math.max(1000, Math.floor(this.idleMs / 2)));
    this.sweeper.unref();
  }

  /** Open backends (for tests and metrics). */
  get size(): number {
    return this.entries.size;
  }

  /** Closes every connection. */
  close(): void {
    if (this.sweeper) clearInterval(this.sweeper);
    this.sweeper = undefined;
    for (const sb of this.entries.values()) sb.close();
    this.entries.clear();
  }
}

/** The process-wide pool that RunConfigSandbox and BrokerSandbox.fromBlock use unless given one. */
export const defaultPool = new SandboxPool();
