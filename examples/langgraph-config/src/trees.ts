// Many files in one round trip: deepagents' uploadFiles as one tar stream the broker extracts
// (the dataplane's untar), instead of one upload per file, and downloadFiles as one tar stream
// the broker writes (the dataplane's tar with paths), instead of one download per file. Kept apart
// from the backend's other operations; docs/dataplane.md describes both.

import { Parser, type ReadEntry } from "tar";
import type { CallOptions, DataplaneClient } from "./dataplane.js";
import { DataplaneError } from "./errors.js";
import { ErrorCode, type TreeResult } from "./protocol.js";

const WORKSPACE = "/workspace";

const BLOCK = 512;
const enc = new TextEncoder();

/** Writes s into h at off, NUL-padded to len (ustar fields). */
function field(h: Uint8Array, off: number, len: number, s: string | Uint8Array) {
  const b = typeof s === "string" ? enc.encode(s) : s;
  h.set(b.subarray(0, len), off);
}

function octal(n: number, len: number): string {
  return n.toString(8).padStart(len - 1, "0");
}

/** One 512-byte ustar header. */
function header(name: Uint8Array, size: number, mode: number, mtime: number, type: string): Uint8Array {
  const h = new Uint8Array(BLOCK);
  field(h, 0, 100, name);
  field(h, 100, 8, octal(mode, 8));
  field(h, 108, 8, octal(0, 8));
  field(h, 116, 8, octal(0, 8));
  field(h, 124, 12, octal(size, 12));
  field(h, 136, 12, octal(mtime, 12));
  field(h, 148, 8, "        ");
  field(h, 156, 1, type);
  field(h, 257, 6, "ustar");
  field(h, 263, 2, "00");
  let sum = 0;
  for (const b of h) sum += b;
  field(h, 148, 8, `${octal(sum, 7)}\0`);
  return h;
}

function padded(n: number): number {
  return Math.ceil(n / BLOCK) * BLOCK;
}

/**
 * A tar stream (ustar, with a PAX path record for names over 100 bytes) of regular files, each
 * name relative to the directory it will be extracted into; mode 0644, mtime now.
 */
export function tarFiles(files: Array<[string, Uint8Array]>, mtime = Math.floor(Date.now() / 1000)): Uint8Array {
  const parts: Uint8Array[] = [];
  let total = 0;
  const push = (b: Uint8Array) => {
    parts.push(b);
    total += b.length;
  };
  const pushData = (b: Uint8Array) => {
    push(b);
    const pad = padded(b.length) - b.length;
    if (pad) push(new Uint8Array(pad));
  };
  for (const [name, content] of files) {
    let n = enc.encode(name);
    if (n.length > 100) {
      // "<len> path=<name>\n", the length counting itself.
      const body = ` path=${name}\n`;
      const bodyLen = enc.encode(body).length;
      let len = bodyLen + 1;
      while (String(len).length + bodyLen !== len) len = String(len).length + bodyLen;
      const rec = enc.encode(`${len}${body}`);
      push(header(enc.encode("PaxHeader"), rec.length, 0o644, mtime, "x"));
      pushData(rec);
      n = n.subarray(0, 100);
    }
    push(header(n, content.length, 0o644, mtime, "0"));
    pushData(content);
  }
  push(new Uint8Array(2 * BLOCK));
  const out = new Uint8Array(total);
  let off = 0;
  for (const p of parts) {
    out.set(p, off);
    off += p.length;
  }
  return out;
}

/**
 * Splits sandbox paths into names relative to the workspace, for one untar into it; a path that
 * is not under the workspace, or names it, is left for the caller (null).
 */
export function workspaceName(sandboxPath: string): string | null {
  if (!sandboxPath.startsWith(`${WORKSPACE}/`)) return null;
  const rel = sandboxPath.slice(WORKSPACE.length + 1);
  const parts = rel.split("/");
  if (rel === "" || parts.some((c) => c === "" || c === "." || c === "..")) return null;
  return rel;
}

/** What a batch gives for one name: the file's bytes, or the broker's refusal of that file alone. */
export type BatchItem = { content: Buffer } | { error: DataplaneError };

function refused(why: string): DataplaneError {
  return new DataplaneError(ErrorCode.Internal, `the broker's tar stream was refused: ${why}`);
}

/**
 * Reads the tar stream of a batch (a tar with paths) as it arrives, trusting nothing in it: it is
 * parsed by node-tar (strict: a bad checksum, a truncated stream or a header that is not tar is an
 * error; no decompression), and only regular files named exactly as asked, each once, are taken.
 * A symlink, hard link, directory or any other entry, a name not asked (an absolute one, one with
 * ..), a name twice or a compressed stream fails the whole batch at that entry, and nothing more
 * is buffered; nothing is written anywhere, so no link is ever followed. Memory holds the content
 * of the files asked for, no more.
 */
export class BatchReader {
  private readonly parser: Parser;
  private readonly got = new Map<string, Buffer>();
  private failure?: DataplaneError;
  private start?: Buffer = Buffer.alloc(0);

  constructor(private readonly asked: ReadonlySet<string>) {
    this.parser = new Parser({
      strict: true,
      brotli: false,
      zstd: false,
      maxDecompressionRatio: 1,
      onReadEntry: (e) => this.entry(e),
    });
    this.parser.on("error", (e: Error) => this.fail(`not a valid tar stream (${e.message})`));
  }

  private fail(why: string): void {
    this.failure ??= refused(why);
  }

  private entry(e: ReadEntry): void {
    const name = e.path;
    if (this.failure) {
      e.resume();
      return;
    }
    if (!this.asked.has(name)) this.fail(`it holds ${JSON.stringify(name.slice(0, 200))}, which was not asked for`);
    else if (e.type !== "File") this.fail(`${JSON.stringify(name)} is a ${e.type}, not a regular file`);
    else if (this.got.has(name)) this.fail(`it holds ${JSON.stringify(name)} twice`);
    if (this.failure) {
      e.resume(); // dropped as it comes
      return;
    }
    this.got.set(name, Buffer.alloc(0)); // taken: a second entry of the name is refused
    const chunks: Buffer[] = [];
    e.on("data", (d: Buffer) => {
      if (!this.failure) chunks.push(d);
    });
    e.on("end", () => {
      if (!this.failure) this.got.set(name, Buffer.concat(chunks));
    });
  }

  /** Takes the next chunk of the stream; throws once the stream is refused. */
  write(chunk: Buffer): void {
    if (this.failure) throw this.failure;
    if (this.start !== undefined) {
      // The first bytes decide whether the stream is compressed: node-tar would inflate gzip on
      // its own, and a batch is never compressed.
      const head = Buffer.concat([this.start, chunk]);
      if (head.length < 2) {
        this.start = head;
        return;
      }
      this.start = undefined;
      if (head[0] === 0x1f && head[1] === 0x8b) this.fail("it is compressed");
      else this.parser.write(head);
    } else this.parser.write(chunk);
    if (this.failure) throw this.failure;
  }

  /**
   * Ends the stream and checks it against the broker's result: every name asked is answered
   * exactly once, as an entry or as an error, and the counts agree.
   */
  finish(res: TreeResult): Map<string, BatchItem> {
    if (this.start !== undefined && this.start.length > 0) this.parser.write(this.start);
    this.start = undefined;
    if (!this.failure) this.parser.end();
    if (this.failure) throw this.failure;
    const out = new Map<string, BatchItem>();
    for (const [name, content] of this.got) out.set(name, { content });
    for (const e of res.errors ?? []) {
      if (!this.asked.has(e.path)) throw refused(`its result names ${JSON.stringify(e.path.slice(0, 200))}, which was not asked for`);
      if (out.has(e.path)) throw refused(`its result answers ${JSON.stringify(e.path)} twice`);
      out.set(e.path, { error: new DataplaneError(e.code, e.message) });
    }
    if (res.files !== this.got.size) throw refused(`its result counts ${res.files} files, the stream holds ${this.got.size}`);
    if (out.size !== this.asked.size) throw refused(`it answers ${out.size} of the ${this.asked.size} files asked for`);
    return out;
  }
}

/**
 * Reads the files names (each relative to the directory dir, each once) in one request, the
 * dataplane's tar with paths: each name's bytes, or the broker's error for that file alone.
 * Throws when the request fails as a whole (a broker without tar paths refuses it) or the stream
 * is refused (BatchReader).
 */
export async function downloadBatch(client: DataplaneClient, dir: string, names: string[], o: CallOptions = {}): Promise<Map<string, BatchItem>> {
  const asked = new Set(names);
  let reader = new BatchReader(asked);
  const res = await client.tar({ path: dir, paths: names }, (b) => reader.write(b), () => (reader = new BatchReader(asked)), o);
  return reader.finish(res);
}
