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
import { BrokerSandbox, UNCONFIGURED_ID, type BrokerSandboxOptions } from "./backend.js";
import type { DataplaneOptions } from "./dataplane.js";
import { DataplaneError, asDataplaneError } from "./errors.js";
import { ErrorCode } from "./protocol.js";
import { dataplaneURLProblem, sandboxBlockOf, type SandboxBlock } from "./runconfig.js";

export { UNCONFIGURED_ID };

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
      return sb;
    }
    const created = BrokerSandbox.fromBlock(block, { ...this.o.dial, ...this.o.sandbox });
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

/** The process-wide pool that RunConfigSandbox uses unless given one. */
export const defaultPool = new SandboxPool();

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

/**
 * Checks a list of broker origins (ws:// or wss://, e.g. "ws://127.0.0.1:7070") and returns them
 * normalised; empty entries are skipped. name (the option or environment variable) starts the
 * error message of a bad entry.
 */
export function parseOrigins(values: string[], name: string): string[] {
  return values
    .map((x) => x.trim())
    .filter(Boolean)
    .map((x) => {
      if (dataplaneURLProblem(x)) {
        throw new Error(`${name}: ${JSON.stringify(x)} is not a broker origin; give ws:// or wss:// origins such as ws://127.0.0.1:7070`);
      }
      return new URL(x).origin;
    });
}

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
    const origins = parseOrigins(o.allowedOrigins ?? [], "allowedOrigins");
    if (origins.length) this.origins = new Set(origins);
  }

  /** The current run's block; throws invalid_run_config when it has none or a malformed one. */
  private block(): SandboxBlock {
    let configurable: unknown;
    try {
      configurable = this.configurable();
    } catch {
      configurable = undefined; // outside a run
    }
    return sandboxBlockOf(configurable);
  }

  /** The current run's sandbox id, read from its block (whenever deepagents resolves the backend; no dialling). */
  get id(): string {
    try {
      return this.block().sandbox_id;
    } catch {
      return UNCONFIGURED_ID;
    }
  }

  /** The current run's backend; without a usable block, one whose every call answers why. */
  resolve(): BrokerSandbox {
    try {
      const block = this.block();
      const origin = new URL(block.dataplane_url).origin;
      if (this.origins && !this.origins.has(origin)) {
        throw new DataplaneError(
          ErrorCode.InvalidRunConfig,
          `dataplane_url ${origin} is not a broker this agent server connects to (allowed: ${[...this.origins].join(", ")})`,
        );
      }
      return this.pool.get(block);
    } catch (e) {
      return BrokerSandbox.failing(asDataplaneError(e));
    }
  }

  ls(path: string): Promise<LsResult> {
    return this.resolve().ls(path);
  }
  read(filePath: string, offset?: number, limit?: number): Promise<ReadResult> {
    return this.resolve().read(filePath, offset, limit);
  }
  readRaw(filePath: string): Promise<ReadRawResult> {
    return this.resolve().readRaw(filePath);
  }
  write(filePath: string, content: string): Promise<WriteResult> {
    return this.resolve().write(filePath, content);
  }
  edit(filePath: string, oldString: string, newString: string, replaceAll?: boolean): Promise<EditResult> {
    return this.resolve().edit(filePath, oldString, newString, replaceAll);
  }
  grep(pattern: string, path?: string | null, glob?: string | null, maxCount?: number | null): Promise<GrepResult> {
    return this.resolve().grep(pattern, path, glob, maxCount);
  }
  glob(pattern: string, path?: string): Promise<GlobResult> {
    return this.resolve().glob(pattern, path);
  }
  delete(filePath: string): Promise<DeleteResult> {
    return this.resolve().delete(filePath);
  }
  execute(command: string): Promise<ExecuteResponse> {
    return this.resolve().execute(command);
  }
  uploadFiles(files: Array<[string, Uint8Array]>): Promise<FileUploadResponse[]> {
    return this.resolve().uploadFiles(files);
  }
  downloadFiles(paths: string[]): Promise<FileDownloadResponse[]> {
    return this.resolve().downloadFiles(paths);
  }
}
