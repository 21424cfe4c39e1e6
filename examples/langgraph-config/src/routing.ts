// Per-run routing: one backend object for a deployed graph, which picks the sandbox of the current
// run from config.configurable.sandbox at call time (getConfig() works inside a run, including the
// backend calls deepagents makes with only {state}). Connections are pooled by sandbox and
// credential, so parallel tool calls and later runs with the same block share one WebSocket.

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
import { BrokerSandbox, SandboxPool, UNCONFIGURED_ID, defaultPool } from "./backend.js";
import { DataplaneError, asDataplaneError } from "./errors.js";
import { ErrorCode } from "./protocol.js";
import { dataplaneURLProblem, sandboxBlockOf, type SandboxBlock } from "./runconfig.js";

export { UNCONFIGURED_ID, SandboxPool, defaultPool };
export type { SandboxPoolOptions } from "./backend.js";

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
