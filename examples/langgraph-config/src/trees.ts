// Many files in one round trip: deepagents' uploadFiles as one tar stream the broker extracts
// (the dataplane's untar), instead of one upload per file. Kept apart from the backend's other
// operations; docs/dataplane.md describes untar.

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
