// One error type for everything the dataplane client can fail with, and the sentences a model reads
// when a tool fails. Callers branch on `code` (protocol/errors.go), never on the message.

import { ErrorCode } from "./protocol.js";

/** A dataplane, handshake or client-side failure: a stable code plus a sentence a person can act on. */
export class DataplaneError extends Error {
  override name = "DataplaneError";
  constructor(
    readonly code: string,
    message: string,
    /** The HTTP status of a refused handshake; 0 on the dataplane itself. */
    readonly status = 0,
  ) {
    super(message);
  }
}

/** The connection could not be made, or broke. Safe operations are retried once on these. */
export function unreachable(message: string): DataplaneError {
  return new DataplaneError(ErrorCode.Unreachable, message);
}

/** Any thrown value as a DataplaneError (a bug in our code surfaces as internal, not a crash). */
export function asDataplaneError(err: unknown): DataplaneError {
  if (err instanceof DataplaneError) return err;
  if (err instanceof Error && err.name === "AbortError") return new DataplaneError(ErrorCode.Cancelled, "the request was cancelled");
  return new DataplaneError(ErrorCode.Internal, err instanceof Error ? err.message : String(err));
}

/**
 * The broker refused the credential itself (a 401 at the handshake, or any token_* code:
 * token_malformed, token_bad_signature, token_not_yet_valid, ...): retrying cannot help, the
 * sandbox's owner must mint a new delegation.
 */
export function isCredentialRefusal(e: DataplaneError): boolean {
  return e.status === 401 || e.code.startsWith("token_");
}

const period = (s: string) => (/[.!?]$/.test(s) ? s : `${s}.`);

/**
 * The sentence a model reads when an operation failed. Ordinary failures come back to deepagents as
 * {error: sentence} (a thrown error would abort the whole run), so each one says what happened and
 * what the model, or the person, can do about it.
 */
export function describeForModel(err: unknown, context?: { path?: string; allowCmd?: string[] }): string {
  const e = asDataplaneError(err);
  const msg = e.message;
  switch (e.code) {
    // The credential: the model cannot fix these, the sandbox's owner can.
    case ErrorCode.TokenRevoked:
      return "Not allowed: the sandbox's owner revoked this credential. Retrying will not help; the owner must send a new run config.";
    case ErrorCode.TokenExpired:
      return "Not allowed: this sandbox credential expired. Retrying will not help; the owner must send a fresh run config (they are short-lived and sent with every run).";
    case ErrorCode.Unauthenticated:
    case ErrorCode.TokenWrongSandbox:
    case ErrorCode.Forbidden:
      return `Not allowed: the broker refused this sandbox credential (${e.code}: ${period(msg)}) Retrying will not help.`;
    case ErrorCode.ScopeDenied:
      return `Not allowed: ${period(msg)} This run's credential does not permit it; do not retry, ask the sandbox's owner for a run config with that scope.`;
    case ErrorCode.CommandNotAllowed: {
      const allowed = context?.allowCmd?.length ? ` Allowed programs: ${context.allowCmd.join(", ")}, as simple commands (no pipes, redirections, ;, &&, $() or VAR=value).` : "";
      return `Not allowed: ${period(msg)}${allowed} The command did not run.`;
    }
    case ErrorCode.InvalidRunConfig:
      return `The sandbox is not configured for this run: ${period(msg)} Tools cannot run until the run carries a valid config.configurable.sandbox block.`;
    // The sandbox's state.
    case ErrorCode.NotRunning:
      return "The sandbox is not running (its owner stopped it or its lease expired). Retrying will not help until its owner resumes it.";
    case ErrorCode.NotFound:
      return `The sandbox does not exist any more (${period(msg)}) Retrying will not help.`;
    case ErrorCode.WrongNode:
      return `The sandbox is hosted by another broker than the one this run config names (${period(msg)}) Retrying will not help; the sandbox's owner must send a new run config.`;
    // Transient: worth another try.
    case ErrorCode.Unreachable:
    case ErrorCode.Unavailable:
      return `The sandbox broker is unreachable right now (${period(msg)}) Try again shortly.`;
    case ErrorCode.TooManyRequests:
      return "The sandbox is busy (too many requests in flight); nothing was started. Try again shortly.";
    case ErrorCode.Internal:
      return `The sandbox broker failed on this request (${period(msg)}) Try again; if it keeps failing, tell the sandbox's owner.`;
    case ErrorCode.Cancelled:
      return "The operation was cancelled.";
    // Files: the broker's messages already say what to do next.
    case ErrorCode.FileNotFound:
      return `File not found: ${period(msg)}`;
    case ErrorCode.IsDirectory:
      return `Is a directory: ${period(msg)}`;
    case ErrorCode.NotDirectory:
      return `Not a directory: ${period(msg)}`;
    case ErrorCode.FileExists:
      return `File exists: ${period(msg)}`;
    case ErrorCode.PermissionDenied:
      return `Permission denied: ${period(msg)}`;
    case ErrorCode.InvalidPath:
      return `Invalid path: ${period(msg)} File tools work inside the sandbox's workspace (/workspace).`;
    case ErrorCode.NoMatch:
      return `String not found in file${context?.path ? ` '${context.path}'` : ""}: ${period(msg)}`;
    case ErrorCode.NotUnique:
      return `${period(msg)} Use replace_all=true to replace every occurrence, or include more surrounding context so the string is unique.`;
    case ErrorCode.TooLarge:
      return `Too large: ${period(msg)}`;
    default:
      if (isCredentialRefusal(e)) {
        return `Not allowed: the broker refused this sandbox credential (${e.code}: ${period(msg)}) Retrying will not help; the sandbox's owner must mint a new delegation (a new run config).`;
      }
      return `The sandbox refused the request (${e.code}: ${period(msg)})`;
  }
}

/** The message a broker close code carries (docs/dataplane.md §6), as the Go client words it. */
export function closeMessage(reason: string): string {
  switch (reason) {
    case ErrorCode.TokenRevoked:
      return "the sandbox's owner revoked this credential";
    case ErrorCode.TokenExpired:
      return "this credential expired; the owner must send a fresh run config";
    case ErrorCode.NotRunning:
      return "the sandbox stopped; its owner must resume it";
    default:
      return `the broker closed the connection: ${reason}`;
  }
}
