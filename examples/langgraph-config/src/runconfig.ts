// The run-config block (DESIGN §5.1), as backend/runconfig.go reads it:
//
//   {"config": {"configurable": {"sandbox": {"sandbox_id": "sb_...", "credential": "<token>",
//     "dataplane_url": "ws://host:port/v1/sandboxes/sb_.../dataplane"}}}}
//
// Extra keys are ignored; missing or mistyped ones are an error that names them.

import { DataplaneError } from "./errors.js";
import { ErrorCode } from "./protocol.js";

/** The value of config.configurable.sandbox. The credential is opaque (a delegation token today). */
export interface SandboxBlock {
  sandbox_id: string;
  credential: string;
  dataplane_url: string;
}

/** The whole object a run request merges in. */
export interface RunConfig {
  config: { configurable: { sandbox: SandboxBlock } };
}

/** The configurable key the block lives under. */
export const SANDBOX_KEY = "sandbox";

function bad(message: string): DataplaneError {
  return new DataplaneError(ErrorCode.InvalidRunConfig, `malformed run config: ${message}`);
}

/** A run without a block. Agent servers keep configurable in thread state, so send one every run. */
export const NO_SANDBOX_MESSAGE =
  "the run config has no sandbox block (configurable.sandbox); send one with every run (sbctl run-config)";

/**
 * What is wrong with a dataplane URL (undefined when nothing): it must be a ws:// or wss:// URL with
 * no query, fragment, user name or password, so that a credential never rides in it (the broker
 * refuses any query; docs/dataplane.md §1). The answer never repeats the URL.
 */
export function dataplaneURLProblem(raw: string): string | undefined {
  let url: URL;
  try {
    url = new URL(raw);
  } catch {
    return "is not a URL";
  }
  if (url.protocol !== "ws:" && url.protocol !== "wss:") return "must be a ws:// or wss:// URL";
  if (/[?#]/.test(raw) || url.username || url.password) {
    return "must not carry a query, fragment, user name or password (the credential travels in its own field)";
  }
  return undefined;
}

/**
 * Extracts and checks the sandbox block of a run's configurable (config.configurable). Returns the
 * block, or throws a DataplaneError with code invalid_run_config whose message names the key.
 */
export function sandboxBlockOf(configurable: unknown): SandboxBlock {
  if (configurable === undefined || configurable === null) {
    throw new DataplaneError(ErrorCode.InvalidRunConfig, NO_SANDBOX_MESSAGE);
  }
  if (typeof configurable !== "object" || Array.isArray(configurable)) throw bad("configurable must be a JSON object");
  const sb = (configurable as Record<string, unknown>)[SANDBOX_KEY];
  if (sb === undefined || sb === null) throw new DataplaneError(ErrorCode.InvalidRunConfig, NO_SANDBOX_MESSAGE);
  if (typeof sb !== "object" || Array.isArray(sb)) {
    throw bad("configurable.sandbox must be an object with sandbox_id, credential and dataplane_url");
  }
  const fields = sb as Record<string, unknown>;
  const out: Record<string, string> = {};
  for (const key of ["sandbox_id", "credential", "dataplane_url"] as const) {
    if (!(key in fields) || fields[key] === undefined) throw bad(`configurable.sandbox.${key} is missing`);
    const v = fields[key];
    if (typeof v !== "string" || v === "") throw bad(`configurable.sandbox.${key} must be a non-empty string`);
    out[key] = v;
  }
  const block = out as unknown as SandboxBlock;
  const problem = dataplaneURLProblem(block.dataplane_url);
  if (problem) throw bad(`configurable.sandbox.dataplane_url ${problem}`);
  return block;
}

/** Wraps a block in the run-config object. */
export function newRunConfig(block: SandboxBlock): RunConfig {
  return { config: { configurable: { sandbox: block } } };
}
