// Per-run routing: one backend object for a deployed graph, which picks the sandbox of the current
// run from config.configurable.sandbox at call time (getConfig() works inside a run, including the
// backend calls deepagents makes with only {state}). Connections are pooled by sandbox and
// credential, so parallel tool calls and later runs with the same block share one WebSocket.

import { createHash } from "node:crypto";
import { getConfig } from "@langchain/langgraph";
import type {
  DeleteResult,
  EditResult,
  ExecuteResponse,
  FileDownloadResponse,
  FileUploadResponse,
  GlobResult,
  GrepResult,
  LsResult,
  ReadRawResult,
  ReadResult,
  SandboxBackendProtocolV2,
  WriteResult,
} from "deepagents";
import { BrokerSandbox, type BrokerSandboxOptions } from "./backend.js";
import type { DataplaneOptions } from "./dataplane.js";
import { DataplaneError, asDataplaneError, describeForModel } from "./errors.js";
import { ErrorCode } from "./protocol.js";
import { sandboxBlockOf, type SandboxBlock } from "./runconfig.js";

/** Options of a pool's connections. */
export interface SandboxPoolOptions {
  /** Most connections kept open; the least recently used beyond it are closed (default 64). */
  maxConnections?: number;
  /** A connection unused for this long is closed (default 10 min); the next call re-dials. */
  idleMs?: number;
  /** Dial tuning (URL, credential and sandbox id come from each block). */
  dial?: Omit<DataplaneOptions, "url" | "credential" | "sandboxId">;
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

  private static keyOf(b: SandboxBlock): string {
    const cred = createHash("sha256").update(b.credential).digest("base64url");
    return `${b.dataplane_url}\n${b.sandbox_id}\n${cred}`;
  }

  /** The backend for a block, created (not yet connected) on first use. */
  get(block: SandboxBlock): BrokerSandbox {
    const key = SandboxPool.keyOf(block);
    let sb = this.entries.get(key);
    if (sb && sb.client.finished) {
      this.entries.delete(key);
      sb = undefined;
    }
    if (sb) {
      // Most recently used last: Map order is the eviction order.
      this.entries.delete(key);
      this.entries.set(key, sb);
      sb.client.lastUsed = Date.now();
      return sb;
    }
    const created = BrokerSandbox.fromBlock(block, { ...this.o.dial, ...this.o.sandbox });
    created.client.onEnded = () => {
      if (this.entries.get(key) === created) this.entries.delete(key);
      created.close();
    };
    this.entries.set(key, created);
    // Over the cap: close the least recently used connections that have nothing in flight (a
    // busy pool may stay over the cap until its requests end).
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

/** The process-wide pool that RunConfigSandbox uses unless given one. */
export const defaultPool = new SandboxPool();

/** The id shown while no valid block is in reach: non-empty, so deepagents keeps the execute tool. */
export const UNCONFIGURED_ID = "sbx-broker";

/** Options of RunConfigSandbox. */
export interface RunConfigSandboxOptions {
  /** Connection pool (default: defaultPool). */
  pool?: SandboxPool;
  /**
   * Where the run's configurable comes from (default: getConfig().configurable, read at each call).
   * Tests and non-LangGraph hosts can pass their own.
   */
  configurable?: () => unknown;
  /**
   * Brokers this agent server connects to, as origins ("wss://broker.example.com",
   * "ws://127.0.0.1:7070"). A block naming any other dataplane is refused before anything is
   * dialled, so a client cannot point the server's connections elsewhere. Default: any.
   */
  allowedOrigins?: string[];
}

type Resolved = { sandbox: BrokerSandbox } | { error: DataplaneError };

/**
 * A deepagents backend for a deployed graph: each call works in the sandbox named by the current
 * run's config.configurable.sandbox block. A missing or malformed block makes every tool answer an
 * error sentence naming the problem; nothing throws.
 */
export class RunConfigSandbox implements SandboxBackendProtocolV2 {
  private readonly pool: SandboxPool;
  private readonly configurable: () => unknown;
  private readonly origins?: Set<string>;

  constructor(o: RunConfigSandboxOptions = {}) {
    this.pool = o.pool ?? defaultPool;
    this.configurable = o.configurable ?? (() => getConfig()?.configurable);
    if (o.allowedOrigins?.length) this.origins = new Set(o.allowedOrigins.map((x) => new URL(x.trim()).origin));
  }

  /** The current run's sandbox id (read whenever deepagents resolves the backend). */
  get id(): string {
    const r = this.resolve();
    return "sandbox" in r ? r.sandbox.id : UNCONFIGURED_ID;
  }

  /** The current run's backend, or why there is none. */
  resolve(): Resolved {
    let configurable: unknown;
    try {
      configurable = this.configurable();
    } catch {
      configurable = undefined; // outside a run
    }
    try {
      const block = sandboxBlockOf(configurable);
      const origin = new URL(block.dataplane_url).origin;
      if (this.origins && !this.origins.has(origin)) {
        throw new DataplaneError(
          ErrorCode.InvalidRunConfig,
          `dataplane_url ${origin} is not a broker this agent server connects to (allowed: ${[...this.origins].join(", ")})`,
        );
      }
      return { sandbox: this.pool.get(block) };
    } catch (e) {
      return { error: asDataplaneError(e) };
    }
  }

  private with<T>(fail: (sentence: string) => T, f: (sb: BrokerSandbox) => Promise<T>): Promise<T> {
    const r = this.resolve();
    if ("error" in r) return Promise.resolve(fail(describeForModel(r.error)));
    return f(r.sandbox);
  }

  ls(path: string): Promise<LsResult> {
    return this.with<LsResult>((error) => ({ error }), (sb) => sb.ls(path));
  }
  read(filePath: string, offset?: number, limit?: number): Promise<ReadResult> {
    return this.with<ReadResult>((error) => ({ error }), (sb) => sb.read(filePath, offset, limit));
  }
  readRaw(filePath: string): Promise<ReadRawResult> {
    return this.with<ReadRawResult>((error) => ({ error }), (sb) => sb.readRaw(filePath));
  }
  write(filePath: string, content: string): Promise<WriteResult> {
    return this.with<WriteResult>((error) => ({ error }), (sb) => sb.write(filePath, content));
  }
  edit(filePath: string, oldString: string, newString: string, replaceAll?: boolean): Promise<EditResult> {
    return this.with<EditResult>((error) => ({ error }), (sb) => sb.edit(filePath, oldString, newString, replaceAll));
  }
  grep(pattern: string, path?: string | null, glob?: string | null, maxCount?: number | null): Promise<GrepResult> {
    return this.with<GrepResult>((error) => ({ error }), (sb) => sb.grep(pattern, path, glob, maxCount));
  }
  glob(pattern: string, path?: string): Promise<GlobResult> {
    return this.with<GlobResult>((error) => ({ error }), (sb) => sb.glob(pattern, path));
  }
  delete(filePath: string): Promise<DeleteResult> {
    return this.with<DeleteResult>((error) => ({ error }), (sb) => sb.delete(filePath));
  }
  execute(command: string): Promise<ExecuteResponse> {
    return this.with<ExecuteResponse>((error) => ({ output: `Error: ${error}`, exitCode: null, truncated: false }), (sb) => sb.execute(command));
  }
  uploadFiles(files: Array<[string, Uint8Array]>): Promise<FileUploadResponse[]> {
    return this.with<FileUploadResponse[]>(() => files.map(([path]) => ({ path, error: "permission_denied" as const })), (sb) => sb.uploadFiles(files));
  }
  downloadFiles(paths: string[]): Promise<FileDownloadResponse[]> {
    return this.with<FileDownloadResponse[]>(() => paths.map((path) => ({ path, content: null, error: "permission_denied" as const })), (sb) => sb.downloadFiles(paths));
  }
}
