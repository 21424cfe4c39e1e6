// The dataplane client: one WebSocket per sandbox credential, many requests in flight on it. It
// mirrors backend/remote.go: request ids (uint32, never 0, never one still in flight), binary
// frames routed to their request by id, a broken connection re-dialled with backoff on the next
// call, requests that are safe to repeat retried once on a fresh connection, and close codes 4001 /
// 4002 treated as final. Cancellation: an AbortSignal sends {"id":N,"op":"cancel"}.

import WebSocket from "ws";
import { DataplaneError, closeMessage, unreachable } from "./errors.js";
import {
  CloseCode,
  ErrorCode,
  FrameKind,
  SUBPROTOCOL,
  decodeResult,
  decodeServerFrame,
  encodeBinaryFrame,
  encodeBodyFrame,
  encodeClientFrame,
  parseBinaryFrame,
  parseBodyFrame,
  readResultOf,
  resultKindOf,
  writeBodyOf,
  type ArgsOf,
  type ClientFrame,
  type ExecArgs,
  type ExecResult,
  type Hello,
  type Op,
  type ReadHead,
  type ResultOf,
  type ServerFrame,
} from "./protocol.js";
import { dataplaneURLProblem } from "./runconfig.js";

/** How to reach one sandbox's dataplane. */
export interface DataplaneOptions {
  /** ws:// or wss:// .../v1/sandboxes/<id>/dataplane */
  url: string;
  /** A delegation token or an owner API key; sent in the Authorization header, never in the URL. */
  credential: string;
  /** When set, the hello must name this sandbox (a block whose URL and id disagree is refused). */
  sandboxId?: string;
  /** Bounds one connection attempt, handshake and hello included (default 10 s). */
  dialTimeoutMs?: number;
  /** How many times a broken connection is re-dialled, with backoff, before calls fail (default 5). */
  reconnects?: number;
  /**
   * Largest frame accepted from the broker (default 64 MiB). max_frame_bytes bounds only what the
   * broker reads: a read answer carries up to 8 MiB of content, which JSON escaping of control
   * bytes grows up to sixfold, and a non-streamed exec answer carries its whole output (keep
   * max_output at 8 MiB or less, or stream). A bigger frame closes the connection under every
   * request on it.
   */
  maxPayloadBytes?: number;
}

/** Per-call options. */
export interface CallOptions {
  /** Aborting sends a cancel for the request; the call rejects with code cancelled. */
  signal?: AbortSignal;
}

/** Output sinks of a streamed exec. */
export interface ExecStreamOptions extends CallOptions {
  /** stdout bytes as they come (all output when stderr has no sink: combined). */
  onStdout?: (chunk: Buffer) => void;
  onStderr?: (chunk: Buffer) => void;
}

// The server closes a connection that sends nothing for 75 s and pings every 30 s; a connection
// that has heard nothing for as long is dead even if TCP has not noticed.
const LIVENESS_MS = 75_000;
const LIVENESS_CHECK_MS = 15_000;

function cancelled(): DataplaneError {
  return new DataplaneError(ErrorCode.Cancelled, "the request was cancelled");
}

/** A URL fit for messages and logs: its origin and path, never a query, fragment or user info. */
function redactURL(u: string): string {
  try {
    const url = new URL(u);
    return url.origin + url.pathname;
  } catch {
    return "the dataplane URL";
  }
}

function clientClosed(): DataplaneError {
  return unreachable("the dataplane client is closed");
}

/** Counts requests in flight against the hello's max_inflight, so that none is refused for it. */
class Slots {
  private active = 0;
  private waiters: Array<{ go: () => void; fail: (e: Error) => void }> = [];
  private broken?: Error;
  constructor(private readonly max: number) {}

  acquire(signal?: AbortSignal): Promise<void> {
    if (this.broken) return Promise.reject(this.broken);
    if (this.active < this.max) {
      this.active++;
      return Promise.resolve();
    }
    return new Promise((resolve, reject) => {
      const w = {
        go: () => {
          signal?.removeEventListener("abort", onAbort);
          this.active++;
          resolve();
        },
        fail: (e: Error) => {
          signal?.removeEventListener("abort", onAbort);
          reject(e);
        },
      };
      const onAbort = () => {
        this.waiters = this.waiters.filter((x) => x !== w);
        reject(cancelled());
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.waiters.push(w);
    });
  }

  release(): void {
    this.active--;
    const next = this.waiters.shift();
    if (next) next.go();
  }

  fail(e: Error): void {
    this.broken = e;
    for (const w of this.waiters.splice(0)) w.fail(e);
  }
}

interface Pending {
  op: Op;
  resolve: (v: unknown) => void;
  reject: (e: Error) => void;
  onStdout?: (b: Buffer) => void;
  onStderr?: (b: Buffer) => void;
  onData?: (b: Buffer) => void;
  sinkError?: Error;
  /** Cancelled by us: the caller has its answer; the entry stays until the broker's, so the id is not reused. */
  cancelled?: boolean;
  settled?: boolean;
}

/** One WebSocket connection and its requests in flight. */
export class Connection {
  private readonly pending = new Map<number, Pending>();
  private nextId = 0;
  private readonly slots: Slots;
  private lastSeen = Date.now();
  private readonly watchdog: NodeJS.Timeout;
  private failure?: DataplaneError;
  /** Set when the connection is gone. */
  dead = false;
  /** Set when the broker closed it for good (4001 / 4002): reconnecting with this credential fails the same way. */
  end?: DataplaneError;
  /** Called once when the connection is gone. */
  onGone?: () => void;

  private constructor(
    private readonly ws: WebSocket,
    readonly hello: Hello,
  ) {
    this.slots = new Slots(Math.max(1, hello.limits.max_inflight));
    ws.on("message", (data: Buffer, isBinary: boolean) => this.onMessage(data, isBinary));
    ws.on("ping", () => (this.lastSeen = Date.now()));
    ws.on("pong", () => (this.lastSeen = Date.now()));
    ws.on("error", (err: Error) => {
      this.failure ??= unreachable(`the dataplane connection broke: ${err.message}`);
    });
    ws.on("close", (code: number, reason: Buffer) => this.onClosed(code, reason.toString()));
    this.watchdog = setInterval(() => {
      if (Date.now() - this.lastSeen > LIVENESS_MS) {
        this.failure ??= unreachable(`the dataplane sent nothing for ${LIVENESS_MS / 1000} s`);
        ws.terminate();
      }
    }, LIVENESS_CHECK_MS);
    this.watchdog.unref();
  }

  /** Opens a connection: the handshake, then the hello. */
  static dial(o: Required<DataplaneOptions>): Promise<Connection> {
    return new Promise((resolve, reject) => {
      let settled = false;
      const ws = new WebSocket(o.url, [SUBPROTOCOL], {
        headers: { Authorization: `Bearer ${o.credential}` },
        perMessageDeflate: false,
        handshakeTimeout: o.dialTimeoutMs,
        maxPayload: o.maxPayloadBytes,
        followRedirects: false,
      });
      const done = (err?: DataplaneError, conn?: Connection) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        ws.removeListener("message", onHello);
        if (err) {
          ws.terminate();
          reject(err);
        } else resolve(conn!);
      };
      const timer = setTimeout(
        () => done(unreachable(`${redactURL(o.url)} did not greet within ${o.dialTimeoutMs} ms`)),
        o.dialTimeoutMs,
      );
      // Refusals before the upgrade carry the REST error body: {"error":{"code","message"}}.
      ws.on("unexpected-response", (_req, res) => {
        const chunks: Buffer[] = [];
        let size = 0;
        res.on("data", (c: Buffer) => {
          if (size < 64 << 10) chunks.push(c);
          size += c.length;
        });
        res.on("error", () => done(unreachable(`the dataplane answered ${res.statusCode}`)));
        res.on("end", () => {
          try {
            const body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
            if (body?.error?.code) {
              done(new DataplaneError(String(body.error.code), String(body.error.message ?? ""), res.statusCode ?? 0));
              return;
            }
          } catch {
            // not the broker's error body
          }
          done(unreachable(`the dataplane answered ${res.statusCode} ${res.statusMessage ?? ""}`.trim()));
        });
      });
      ws.on("error", (err: Error) => done(unreachable(`cannot reach ${redactURL(o.url)}: ${err.message}`)));
      ws.on("close", (code: number, reason: Buffer) =>
        done(unreachable(`the dataplane closed before its hello (${code} ${reason.toString()})`.trim())),
      );
      const onHello = (data: Buffer, isBinary: boolean) => {
        try {
          if (isBinary) throw new Error("a binary frame");
          const f = decodeServerFrame(data.toString("utf8"));
          if (!("hello" in f)) throw new Error("not a hello frame");
          if (ws.protocol !== SUBPROTOCOL) throw new Error(`subprotocol ${JSON.stringify(ws.protocol)} selected`);
          if (o.sandboxId && f.hello.sandbox_id !== o.sandboxId) {
            done(
              new DataplaneError(
                ErrorCode.TokenWrongSandbox,
                `the dataplane reached sandbox ${f.hello.sandbox_id}, not ${o.sandboxId}`,
              ),
            );
            return;
          }
          ws.removeAllListeners("error");
          ws.removeAllListeners("close");
          ws.removeAllListeners("unexpected-response");
          done(undefined, new Connection(ws, f.hello));
        } catch (e) {
          done(unreachable(`the dataplane did not greet: ${(e as Error).message}`));
        }
      };
      ws.on("message", onHello);
    });
  }

  private onMessage(data: Buffer, isBinary: boolean): void {
    this.lastSeen = Date.now();
    if (isBinary) {
      if (data.length > 0 && data[0] === FrameKind.AnswerBody) {
        let bf, f;
        try {
          bf = parseBodyFrame(data);
          f = decodeServerFrame(bf.json);
        } catch {
          return;
        }
        if ("hello" in f || f.id !== bf.id) return;
        this.settle(f, bf.body);
        return;
      }
      let f;
      try {
        f = parseBinaryFrame(data);
      } catch {
        return;
      }
      const p = this.pending.get(f.id);
      if (!p || p.cancelled || p.sinkError) return;
      const sink = f.kind === FrameKind.Stdout ? p.onStdout : f.kind === FrameKind.Stderr ? p.onStderr : f.kind === FrameKind.Data ? p.onData : undefined;
      try {
        sink?.(f.payload);
      } catch (e) {
        p.sinkError = e as Error;
      }
      return;
    }
    let f;
    try {
      f = decodeServerFrame(data.toString("utf8"));
    } catch {
      return; // not a frame of this protocol; nothing waits for it
    }
    if ("hello" in f) return;
    this.settle(f);
  }

  /** Ends the call an answer is for; body is the answer frame's body (a read's content), if it came with one. */
  private settle(f: Exclude<ServerFrame, { hello: Hello }>, body?: Buffer): void {
    const p = this.pending.get(f.id);
    if (!p) return; // id 0 (a frame error) or an answer nobody waits for
    this.pending.delete(f.id);
    this.slots.release();
    if (p.cancelled) return;
    if ("error" in f) {
      p.reject(new DataplaneError(f.error.code, f.error.message));
      return;
    }
    if (p.sinkError) {
      p.reject(p.sinkError);
      return;
    }
    try {
      const result = decodeResult(resultKindOf(p.op), f.result);
      p.resolve(body && p.op === "read" ? readResultOf(result as ReadHead, body) : result);
    } catch (e) {
      p.reject(new DataplaneError(ErrorCode.Internal, `the dataplane answered ${p.op} with an unexpected result: ${(e as Error).message}`));
    }
  }

  private onClosed(code: number, reason: string): void {
    if (this.dead) return;
    this.dead = true;
    clearInterval(this.watchdog);
    if (code === CloseCode.CredentialEnded || code === CloseCode.SandboxGone) {
      const r = reason || (code === CloseCode.CredentialEnded ? ErrorCode.TokenRevoked : ErrorCode.NotRunning);
      this.end = new DataplaneError(r, closeMessage(r));
    }
    const err = this.gone(code, reason);
    for (const p of this.pending.values()) if (!p.cancelled) p.reject(err);
    this.pending.clear();
    this.slots.fail(err);
    this.onGone?.();
  }

  /** The error calls get once the connection is gone. */
  private gone(code?: number, reason?: string): DataplaneError {
    if (this.end) return this.end;
    if (this.failure) return this.failure;
    return unreachable(`the dataplane connection closed (${code ?? ""}${reason ? ` ${reason}` : ""})`);
  }

  private allocId(): number {
    do {
      this.nextId = (this.nextId + 1) >>> 0;
    } while (this.nextId === 0 || this.pending.has(this.nextId));
    return this.nextId;
  }

  private send(data: string | Buffer): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.dead || this.ws.readyState !== WebSocket.OPEN) {
        reject(this.gone());
        return;
      }
      this.ws.send(data, (err) => {
        if (err) {
          this.failure ??= unreachable(`writing to the dataplane failed: ${err.message}`);
          this.ws.terminate();
          reject(this.gone());
        } else resolve();
      });
    });
  }

  /** Sends one request and waits for its answer. upload, when set, follows as data frames and an end frame. */
  async request<O extends Op>(
    op: O,
    args: ArgsOf<O>,
    opts: CallOptions & {
      onStdout?: (b: Buffer) => void;
      onStderr?: (b: Buffer) => void;
      onData?: (b: Buffer) => void;
      upload?: Uint8Array;
      /** The request's body (a write's content): the request goes as one frame of kind 5 with it. */
      body?: Uint8Array;
    } = {},
  ): Promise<ResultOf<O>> {
    if (this.dead) throw this.gone();
    if (opts.signal?.aborted) throw cancelled();
    await this.slots.acquire(opts.signal);
    const id = this.allocId();
    const json = encodeClientFrame({ id, op, args } as ClientFrame);
    const text = opts.body ? encodeBodyFrame(FrameKind.RequestBody, id, json, opts.body) : json;
    // A frame over max_frame_bytes would make the broker close the connection (1009) under every
    // other request on it: refuse it here.
    const size = typeof text === "string" ? Buffer.byteLength(text) : text.length;
    if (size > this.hello.limits.max_frame_bytes) {
      this.slots.release();
      throw new DataplaneError(
        ErrorCode.TooLarge,
        `the ${op} request is ${size} bytes, over the dataplane's frame limit of ${this.hello.limits.max_frame_bytes} bytes`,
      );
    }
    return new Promise<ResultOf<O>>((resolve, reject) => {
      const signal = opts.signal;
      const onAbort = () => this.cancel(id);
      const p: Pending = {
        op,
        resolve: (v) => {
          p.settled = true;
          signal?.removeEventListener("abort", onAbort);
          resolve(v as ResultOf<O>);
        },
        reject: (e) => {
          p.settled = true;
          signal?.removeEventListener("abort", onAbort);
          reject(e);
        },
        onStdout: opts.onStdout,
        onStderr: opts.onStderr,
        onData: opts.onData,
      };
      this.pending.set(id, p);
      signal?.addEventListener("abort", onAbort, { once: true });
      this.send(text).catch(() => undefined); // a failed write kills the connection, which rejects p
      if (opts.upload) this.sendUpload(id, p, opts.upload).catch(() => undefined);
    });
  }

  private async sendUpload(id: number, p: Pending, bytes: Uint8Array): Promise<void> {
    const chunk = Math.max(1, this.hello.limits.max_chunk_bytes);
    for (let off = 0; off < bytes.length; off += chunk) {
      if (p.settled) return; // refused early (scope, path): stop sending
      await this.send(encodeBinaryFrame(FrameKind.Data, id, bytes.subarray(off, off + chunk)));
    }
    if (!p.settled) await this.send(encodeBinaryFrame(FrameKind.End, id));
  }

  /** Asks the broker to stop request id; its caller gets cancelled at once. */
  cancel(id: number): void {
    const p = this.pending.get(id);
    if (!p || p.cancelled) return;
    p.cancelled = true;
    p.reject(cancelled());
    this.send(encodeClientFrame({ id, op: "cancel" })).catch(() => undefined);
  }

  /** Closes the connection; requests in flight fail. */
  close(): void {
    this.failure ??= unreachable("the dataplane client was closed");
    if (this.ws.readyState === WebSocket.OPEN || this.ws.readyState === WebSocket.CONNECTING) this.ws.close(1000);
    // Do not wait for the close handshake to settle callers.
    this.onClosed(1000, "");
  }

  /** Requests in flight (for tests and metrics). */
  get inflight(): number {
    return this.pending.size;
  }
}

// Paths travel in JSON text frames: a lone surrogate would be encoded as U+FFFD by the broker and
// name another file, so refuse it (backend/remote.go validPaths).
const loneSurrogate = /\p{Surrogate}/u;
function validPaths(...paths: Array<string | undefined>): void {
  for (const p of paths) {
    if (p !== undefined && loneSurrogate.test(p)) {
      throw new DataplaneError(ErrorCode.InvalidPath, `path ${JSON.stringify(p)} is not valid UTF-8`);
    }
  }
}

/** Options of an operation that may be retried. */
interface Call extends CallOptions {
  retry: boolean;
}

/**
 * A sandbox's dataplane: one connection shared by every call, each with its own request id. Safe
 * for concurrent use. A broken connection is re-dialled on the next call; calls that are safe to
 * repeat (reads, listings, searches, overwrites and overwriting uploads) are retried once on a fresh connection; others
 * fail with code unreachable. Close codes 4001 / 4002 end the client for good (`ended`).
 */
export class DataplaneClient {
  private readonly o: Required<DataplaneOptions>;
  private conn?: Connection;
  private dialing?: Promise<Connection>;
  private closed = false;
  /** Set when the broker closed the connection for good (revoked, expired, sandbox stopped). */
  ended?: DataplaneError;
  /** What the broker said when the last connection opened: scopes, limits, expiry. */
  hello?: Hello;
  /** Called once when the client ends for good. */
  onEnded?: (err: DataplaneError) => void;
  /** When a call last started or ended (for pools). */
  lastUsed = Date.now();
  /** Calls under way, from their start (dialling included) to their answer. */
  private busy = 0;

  constructor(o: DataplaneOptions) {
    if (!o.url || !o.credential) {
      throw new DataplaneError(ErrorCode.InvalidArgument, "a dataplane URL and a credential are required");
    }
    const problem = dataplaneURLProblem(o.url);
    if (problem) throw new DataplaneError(ErrorCode.InvalidArgument, `the dataplane URL ${problem}`);
    this.o = {
      url: o.url,
      credential: o.credential,
      sandboxId: o.sandboxId ?? "",
      dialTimeoutMs: o.dialTimeoutMs ?? 10_000,
      reconnects: o.reconnects ?? 5,
      maxPayloadBytes: o.maxPayloadBytes ?? 64 << 20,
    };
  }

  /** A client whose every call fails with err: never dialled, ended from the start. */
  static failing(err: DataplaneError): DataplaneClient {
    const c = new DataplaneClient({ url: "ws://failing.invalid/", credential: "-" });
    c.ended = err;
    return c;
  }

  /** Connects now (otherwise the first call does) and returns the hello. */
  connect(signal?: AbortSignal): Promise<Hello> {
    return this.track(async () => (await this.connection(signal)).hello);
  }

  /** The sandbox id: the configured one, else the hello's once connected. */
  get sandboxId(): string {
    return this.o.sandboxId || this.hello?.sandbox_id || "";
  }

  /** Closes the connection; later calls fail. */
  close(): void {
    this.closed = true;
    this.conn?.close();
    this.conn = undefined;
  }

  /** Calls under way, from their start (dialling included): a pool must not close a busy client. */
  get inflight(): number {
    return this.busy;
  }

  /** Runs one call, counted in inflight and lastUsed from its start to its end. */
  private async track<T>(f: () => Promise<T>): Promise<T> {
    this.busy++;
    this.lastUsed = Date.now();
    try {
      return await f();
    } finally {
      this.busy--;
      this.lastUsed = Date.now();
    }
  }

  /** True when the client can never work again (closed, or ended by the broker). */
  get finished(): boolean {
    return this.closed || this.ended !== undefined;
  }

  private end(err: DataplaneError): DataplaneError {
    if (!this.ended) {
      this.ended = err;
      this.onEnded?.(err);
    }
    return err;
  }

  /** A live connection, dialling (with backoff, shared by concurrent callers) when there is none. */
  private async connection(signal?: AbortSignal): Promise<Connection> {
    if (this.closed) throw clientClosed();
    if (this.ended) throw this.ended;
    const c = this.conn;
    if (c && !c.dead) return c;
    if (c?.end) throw this.end(c.end);
    this.dialing ??= this.dialWithBackoff().finally(() => (this.dialing = undefined));
    if (!signal) return this.dialing;
    if (signal.aborted) throw cancelled();
    return new Promise((resolve, reject) => {
      const onAbort = () => reject(cancelled());
      signal.addEventListener("abort", onAbort, { once: true });
      this.dialing!.then(resolve, reject).finally(() => signal.removeEventListener("abort", onAbort));
    });
  }

  private async dialWithBackoff(): Promise<Connection> {
    let last: unknown;
    for (let attempt = 0; attempt <= this.o.reconnects; attempt++) {
      if (attempt > 0) await new Promise((r) => setTimeout(r, Math.min(100 * 2 ** (attempt - 1), 5_000)));
      if (this.closed) throw clientClosed();
      try {
        const c = await Connection.dial(this.o);
        if (this.closed) {
          c.close();
          throw clientClosed();
        }
        c.onGone = () => {
          if (c.end) this.end(c.end);
        };
        this.conn = c;
        this.hello = c.hello;
        return c;
      } catch (e) {
        last = e;
        // Refused for a reason that retrying does not change (a bad token, a stopped sandbox).
        if (e instanceof DataplaneError && e.code !== ErrorCode.Unreachable && e.code !== ErrorCode.Unavailable) throw e;
      }
    }
    throw last;
  }

  private call<O extends Op>(
    op: O,
    args: ArgsOf<O>,
    c: Call,
    extra: { onData?: (b: Buffer) => void; reset?: () => void; upload?: Uint8Array; body?: Uint8Array } = {},
  ): Promise<ResultOf<O>> {
    return this.track(async () => {
      for (let attempt = 0; ; attempt++) {
        const conn = await this.connection(c.signal);
        try {
          return await conn.request(op, args, { signal: c.signal, onData: extra.onData, upload: extra.upload, body: extra.body });
        } catch (e) {
          if (c.retry && attempt === 0 && e instanceof DataplaneError && e.code === ErrorCode.Unreachable) {
            extra.reset?.();
            continue;
          }
          throw e;
        }
      }
    });
  }

  /** Measures a round trip. */
  ping(o: CallOptions = {}) {
    return this.call("ping", undefined, { ...o, retry: true });
  }

  env(o: CallOptions = {}) {
    return this.call("env", undefined, { ...o, retry: true });
  }

  stat(path: string, o: CallOptions = {}) {
    validPaths(path);
    return this.call("stat", { path }, { ...o, retry: true });
  }

  ls(path: string, o: CallOptions = {}) {
    validPaths(path);
    return this.call("ls", { path }, { ...o, retry: true });
  }

  read(args: ArgsOf<"read">, o: CallOptions = {}) {
    validPaths(args.path);
    return this.call("read", args, { ...o, retry: true });
  }

  /** Writes a whole file atomically. An overwrite of the same bytes is safe to repeat; a create is not. */
  write(args: ArgsOf<"write">, o: CallOptions = {}) {
    validPaths(args.path);
    let wire;
    try {
      wire = writeBodyOf(args);
    } catch (e) {
      return Promise.reject(new DataplaneError(ErrorCode.InvalidArgument, (e as Error).message));
    }
    // The content goes as the frame's body, raw; the args carry only the path and the mode.
    return this.call("write", wire.head as ArgsOf<"write">, { ...o, retry: args.mode !== "create" }, { body: wire.body });
  }

  edit(args: ArgsOf<"edit">, o: CallOptions = {}) {
    validPaths(args.path);
    return this.call("edit", args, { ...o, retry: false });
  }

  delete(args: ArgsOf<"delete">, o: CallOptions = {}) {
    validPaths(args.path);
    return this.call("delete", args, { ...o, retry: false });
  }

  mkdir(args: ArgsOf<"mkdir">, o: CallOptions = {}) {
    validPaths(args.path);
    return this.call("mkdir", args, { ...o, retry: args.parents === true });
  }

  move(args: ArgsOf<"move">, o: CallOptions = {}) {
    validPaths(args.from, args.to);
    return this.call("move", args, { ...o, retry: false });
  }

  glob(args: ArgsOf<"glob">, o: CallOptions = {}) {
    validPaths(args.path, args.pattern);
    return this.call("glob", args, { ...o, retry: true });
  }

  grep(args: ArgsOf<"grep">, o: CallOptions = {}) {
    validPaths(args.path);
    return this.call("grep", args, { ...o, retry: true });
  }

  /** Runs a command. Never retried: a command may not be safe to run twice. With sinks, output streams. */
  exec(args: ExecArgs, o: ExecStreamOptions = {}): Promise<ExecResult> {
    const a: ExecArgs = { ...args };
    if (o.onStdout) {
      a.stream = true;
      if (!o.onStderr) a.combined = true;
    }
    return this.track(async () => {
      const conn = await this.connection(o.signal);
      return conn.request("exec", a, { signal: o.signal, onStdout: o.onStdout, onStderr: o.onStderr });
    });
  }

  /**
   * Streams bytes into path as data frames (atomically replaced when the end frame arrives). Like a
   * write, an overwrite is retried once on a fresh connection; a create is not.
   */
  upload(path: string, bytes: Uint8Array, o: CallOptions & { mode?: "overwrite" | "create" } = {}) {
    validPaths(path);
    const args: ArgsOf<"upload"> = o.mode ? { path, mode: o.mode } : { path };
    return this.call("upload", args, { signal: o.signal, retry: o.mode !== "create" }, { upload: bytes });
  }

  /**
   * Extracts a tar stream into the directory dir (created if missing) in one round trip; the broker
   * refuses a hostile archive and changes nothing outside dir. Not retried: entries before a
   * failure stay extracted.
   */
  untar(dir: string, archive: Uint8Array, o: CallOptions = {}) {
    validPaths(dir);
    return this.call("untar", { path: dir }, { signal: o.signal, retry: false }, { upload: archive });
  }

  /**
   * A tar stream from the broker, its chunks given to sink as they come: a tree ({path}), or a
   * batch of files in the directory path ({path, paths}). Retried once like a read: reset is
   * called first, and the sink starts over.
   */
  tar(args: ArgsOf<"tar">, sink: (chunk: Buffer) => void, reset: () => void, o: CallOptions = {}) {
    validPaths(args.path, ...(args.paths ?? []));
    return this.call("tar", args, { ...o, retry: true }, { onData: sink, reset });
  }

  /** A file's bytes, from data frames. Retried once like a read (the buffer starts over). */
  async download(path: string, o: CallOptions = {}): Promise<Buffer> {
    validPaths(path);
    let chunks: Buffer[] = [];
    await this.call(
      "download",
      { path },
      { ...o, retry: true },
      { onData: (b) => chunks.push(Buffer.from(b)), reset: () => (chunks = []) },
    );
    return Buffer.concat(chunks);
  }
}
