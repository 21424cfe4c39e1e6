// uploadFiles in one tar stream (the dataplane's untar): the archive GNU tar reads back, and on a
// real broker the same files as deepagents' LocalShellBackend, in one synced event; a file the
// tar cannot carry still gets its own answer. downloadFiles in one tar request (the dataplane's tar
// with paths): the same answers as one download per file, a stream that is refused unless it holds
// exactly what was asked, and one download per file again when the batch fails.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { LocalShellBackend, type FileDownloadResponse } from "deepagents";
import { Header } from "tar";
import { BrokerSandbox } from "../src/backend.js";
import { Connection, DataplaneClient } from "../src/dataplane.js";
import { DataplaneError } from "../src/errors.js";
import type { ArgsOf, Op, TreeResult } from "../src/protocol.js";
import { BatchReader, tarFiles } from "../src/trees.js";
import { startBroker, type Broker } from "./helpers/broker.js";

const long = `deep/${"n".repeat(140)}.txt`; // over ustar's 100 bytes: a PAX path record
const bin = new Uint8Array(70_000).map((_, i) => (i * 31 + 7) % 256);
const files: Array<[string, Uint8Array]> = [
  ["/a.txt", new TextEncoder().encode("alpha\n")],
  ["/src/b.bin", bin],
  [`/${long}`, new TextEncoder().encode("long\n")],
  ["/empty", new Uint8Array(0)],
];

describe("tarFiles", () => {
  it("writes an archive GNU tar lists and extracts byte for byte", async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-tar-"));
    try {
      const archive = tarFiles(files.map(([p, c]) => [p.slice(1), c]));
      assert.equal(archive.length % 512, 0);
      const listing = execFileSync("tar", ["t"], { input: archive }).toString().trim().split("\n");
      assert.deepEqual(listing, ["a.txt", "src/b.bin", long, "empty"]);
      execFileSync("tar", ["x", "-C", dir], { input: archive });
      assert.deepEqual(new Uint8Array(execFileSync("cat", [join(dir, "src/b.bin")])), bin);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("uploadFiles and downloadFiles on a broker", { timeout: 120_000 }, () => {
  let broker: Broker;
  let ours: BrokerSandbox;
  let theirs: LocalShellBackend;
  let dir: string;
  before(async () => {
    broker = await startBroker();
    await broker.create("trees");
    ours = BrokerSandbox.dedicated(await broker.block("trees", "--expires", "10m"));
    dir = await mkdtemp(join(tmpdir(), "sbx-trees-"));
    theirs = new LocalShellBackend({ rootDir: dir, virtualMode: true });
  });
  after(async () => {
    ours?.close();
    await broker?.stop();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("uploads many files in one untar and reads them back as deepagents' own backend does", async () => {
    const [a, b] = await Promise.all([ours.uploadFiles(files), theirs.uploadFiles(files)]);
    assert.deepEqual(a, b);
    assert.deepEqual(a.map((r) => r.error), [null, null, null, null]);
    const paths = files.map(([p]) => p);
    const [da, db] = await Promise.all([ours.downloadFiles(paths), theirs.downloadFiles(paths)]);
    assert.deepEqual(da.map((r) => [r.path, r.error, Buffer.from(r.content ?? []).toString("base64")]),
      db.map((r) => [r.path, r.error, Buffer.from(r.content ?? []).toString("base64")]));
    // The broker's event writer gathers events for a few ms before it writes them: the last one
    // may land just after the download's answer, so the log is read until it holds both.
    let synced: { direction: string; files: number }[] = [];
    for (const deadline = Date.now() + 10_000; synced.length < 2 && Date.now() < deadline; ) {
      if (synced.length > 0) await new Promise((r) => setTimeout(r, 50));
      synced = (await broker.sbctl("events", "trees", "-o", "json", "--backlog", "200"))
        .trim().split("\n").filter((l) => l !== "").map((l) => JSON.parse(l)).filter((e) => e.type === "synced");
    }
    assert.deepEqual(synced.map((e) => [e.direction, e.files]), [["in", 4], ["out", 4]], "one tar stream each way, one synced event each");
  });

  it("a file the tar cannot carry gets its own answer, the others are written", async () => {
    const r = await ours.uploadFiles([["/ok.txt", new TextEncoder().encode("ok\n")], ["/dir/../../escape", new Uint8Array(1)]]);
    assert.equal(r[0]!.error, null);
    assert.notEqual(r[1]!.error, null);
    const d = await ours.downloadFiles(["/ok.txt"]);
    assert.equal(Buffer.from(d[0]!.content!).toString(), "ok\n");
  });
});

/** The ops of every dataplane request sent while f runs (every request goes through Connection.request). */
async function requestsDuring<T>(f: () => Promise<T>): Promise<{ value: T; ops: string[] }> {
  const ops: string[] = [];
  const orig = Connection.prototype.request;
  Connection.prototype.request = function (this: Connection, op: Op, ...rest: unknown[]) {
    ops.push(op);
    return (orig as (...a: unknown[]) => unknown).call(this, op, ...rest);
  } as typeof orig;
  try {
    return { value: await f(), ops };
  } finally {
    Connection.prototype.request = orig;
  }
}

const answers = (r: FileDownloadResponse[]) => r.map((x) => [x.path, x.error, x.content === null ? null : Buffer.from(x.content).toString("base64")]);

describe("downloadFiles in one round trip", { timeout: 120_000 }, () => {
  let broker: Broker;
  let ours: BrokerSandbox;
  let theirs: LocalShellBackend;
  let dir: string;
  before(async () => {
    broker = await startBroker();
    await broker.create("batch");
    ours = BrokerSandbox.dedicated(await broker.block("batch", "--expires", "10m"));
    dir = await mkdtemp(join(tmpdir(), "sbx-batch-"));
    theirs = new LocalShellBackend({ rootDir: dir, virtualMode: true });
  });
  after(async () => {
    ours?.close();
    await broker?.stop();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("5 files, a missing one, a directory and a repeat: one tar request, each path answered as deepagents' own backend does", async () => {
    const five: Array<[string, Uint8Array]> = [
      ["/dl/1.txt", new TextEncoder().encode("one\n")],
      ["/dl/2.txt", new TextEncoder().encode("two\n")],
      ["/dl/empty", new Uint8Array(0)],
      [`/dl/${long}`, new TextEncoder().encode("long\n")],
      ["/dl/sub/5.bin", new Uint8Array(3 << 20).map((_, i) => (i * 7) % 251)], // several chunks
    ];
    for (const b of [ours, theirs]) assert.deepEqual((await b.uploadFiles(five)).map((r) => r.error), [null, null, null, null, null]);
    const asked = [...five.map(([p]) => p), "/dl/missing.txt", "/dl/sub", "/dl/1.txt"];
    const { value: got, ops } = await requestsDuring(() => ours.downloadFiles(asked));
    assert.deepEqual(ops, ["tar"], "one request for every file");
    assert.deepEqual(answers(got), answers(await theirs.downloadFiles(asked)));
    assert.deepEqual(got.map((r) => r.error), [null, null, null, null, null, "file_not_found", "is_directory", null]);
    assert.notEqual(got[0]!.content, got[7]!.content, "a path asked twice gets its own copy");
  });

  it("symlinks, a FIFO and a path that leaves the workspace: the answers a download of each gives", async () => {
    const setup = await ours.execute("mkdir -p dl2 && cd dl2 && printf hi > f && ln -s f in && ln -s /etc/passwd out && ln -s .. up && mkfifo p");
    assert.equal(setup.exitCode, 0, setup.output);
    const asked = ["/dl2/f", "/dl2/in", "/dl2/out", "/dl2/p", "/dl2/up", "/dl2/../../escape"];
    const { value: got, ops } = await requestsDuring(() => ours.downloadFiles(asked));
    assert.deepEqual(ops.sort(), ["download", "tar"], "the path that leaves the workspace goes alone");
    const alone = [];
    for (const p of asked) alone.push(...(await ours.downloadFiles([p])));
    assert.deepEqual(answers(got), answers(alone));
    assert.deepEqual(got.map((r) => r.error), [null, null, "invalid_path", "invalid_path", "is_directory", "invalid_path"]);
    assert.equal(Buffer.from(got[1]!.content!).toString(), "hi", "a symlink inside the workspace is followed, as a download follows it");
  });
});

/** One tar entry built by node-tar's header encoder: whatever a hostile broker could send. */
function entry(h: { path: string; type?: string; linkpath?: string }, body = Buffer.alloc(0)): Buffer {
  const head = Buffer.alloc(512);
  new Header({ path: h.path, type: (h.type ?? "File") as never, linkpath: h.linkpath, size: body.length, mode: 0o644, mtime: new Date(0) }).encode(head, 0);
  const pad = Buffer.alloc((512 - (body.length % 512)) % 512);
  return Buffer.concat([head, body, pad]);
}
const archive = (...entries: Buffer[]) => Buffer.concat([...entries, Buffer.alloc(1024)]);
const tree = (files: number, errors?: TreeResult["errors"]): TreeResult => ({ path: "/workspace", files, dirs: 0, symlinks: 0, bytes: 0, errors });

/** Feeds an archive in small chunks, as frames would bring it, then finishes it against res. */
function readBatch(asked: string[], bytes: Buffer, res: TreeResult) {
  const r = new BatchReader(new Set(asked));
  for (let off = 0; off < bytes.length; off += 300) r.write(bytes.subarray(off, off + 300));
  return r.finish(res);
}

describe("the batch's tar stream is trusted less than nothing", () => {
  const a = entry({ path: "a" }, Buffer.from("A"));
  const b = entry({ path: "dir/b" }, Buffer.from("B"));
  const asked = ["a", "dir/b"];

  it("takes exactly the files asked, each once, with the broker's errors for the rest", () => {
    const got = readBatch([...asked, "gone"], archive(a, b), tree(2, [{ path: "gone", code: "file_not_found", message: "/workspace/gone does not exist" }]));
    assert.equal((got.get("a") as { content: Buffer }).content.toString(), "A");
    assert.equal((got.get("dir/b") as { content: Buffer }).content.toString(), "B");
    assert.equal((got.get("gone") as { error: DataplaneError }).error.code, "file_not_found");
  });

  it("reads what tarFiles and GNU tar write (PAX long names)", () => {
    const bytes = Buffer.from(tarFiles([[long, Buffer.from("L")], ["a", Buffer.alloc(70_000, 1)]]));
    const got = readBatch([long, "a"], bytes, tree(2));
    assert.equal((got.get(long) as { content: Buffer }).content.toString(), "L");
    assert.equal((got.get("a") as { content: Buffer }).content.length, 70_000);
  });

  const refused: Array<[string, Buffer, TreeResult, RegExp]> = [
    ["an entry not asked", archive(a, entry({ path: "c" }, Buffer.from("C"))), tree(2), /not asked/],
    ["a name that climbs out", archive(a, entry({ path: "../dir/b" }, Buffer.from("B"))), tree(2), /not asked/],
    ["an absolute name", archive(a, entry({ path: "/dir/b" }, Buffer.from("B"))), tree(2), /not asked/],
    ["a symlink", archive(a, entry({ path: "dir/b", type: "SymbolicLink", linkpath: "/etc/passwd" })), tree(2), /not a regular file/],
    ["a hard link", archive(a, entry({ path: "dir/b", type: "Link", linkpath: "a" })), tree(2), /not a regular file/],
    ["a directory", archive(a, entry({ path: "dir/b/", type: "Directory" })), tree(2), /not (a regular file|asked)/],
    ["an entry twice", archive(a, a, b), tree(3), /twice/],
    ["a name answered neither as an entry nor an error", archive(a), tree(1), /1 of the 2/],
    ["an error for a name not asked", archive(a, b), tree(2, [{ path: "x", code: "file_not_found", message: "m" }]), /not asked/],
    ["an error for a name also sent", archive(a, b), tree(2, [{ path: "a", code: "file_not_found", message: "m" }]), /twice/],
    ["a count that disagrees", archive(a, b), tree(3), /counts 3 files/],
    ["a stream cut inside a file", archive(a, entry({ path: "dir/b" }, Buffer.alloc(5000, 1))).subarray(0, 3000), tree(2), /not a valid tar/],
    ["a stream cut inside a header", archive(a, b).subarray(0, 1200), tree(2), /refused/],
    ["a bad checksum", archive(a, Buffer.concat([Buffer.from("x"), b.subarray(1)])), tree(2), /not a valid tar/],
    ["a compressed stream", Buffer.concat([Buffer.from([0x1f, 0x8b, 8, 0]), Buffer.alloc(2000)]), tree(0), /compressed/],
  ];
  for (const [what, bytes, res, why] of refused) {
    it(`refuses ${what}`, () => {
      assert.throws(() => readBatch(asked, bytes, res), (e: DataplaneError) => e instanceof DataplaneError && why.test(e.message));
    });
  }

  it("stops buffering at the first refused entry", () => {
    const r = new BatchReader(new Set(asked));
    assert.throws(() => r.write(archive(entry({ path: "c" }, Buffer.alloc(4096)))), /not asked/);
    assert.throws(() => r.write(Buffer.alloc(512)), /not asked/, "the reader stays failed");
  });
});

/** A client whose tar fails as given and whose downloads answer from files. */
class BatchStub extends DataplaneClient {
  readonly ops: string[] = [];
  constructor(private readonly tarAnswer: (sink: (b: Buffer) => void) => Promise<TreeResult>, private readonly files: Record<string, string>) {
    super({ url: "ws://127.0.0.1:9/v1/sandboxes/sb_1/dataplane", credential: "t", sandboxId: "sb_1" });
  }
  override tar(_a: ArgsOf<"tar">, sink: (b: Buffer) => void) {
    this.ops.push("tar");
    return this.tarAnswer(sink);
  }
  override download(p: string) {
    this.ops.push("download");
    const f = this.files[p];
    return f === undefined ? Promise.reject(new DataplaneError("file_not_found", `${p} does not exist`)) : Promise.resolve(Buffer.from(f));
  }
}

describe("a batch that fails falls back to one download per file", () => {
  const files = { "/workspace/a": "A", "/workspace/b": "B" };
  const want = [["/a", null, "QQ=="], ["/b", null, "Qg=="], ["/c", "file_not_found", null]];

  it("a broker without tar paths (it refuses the unknown key)", async () => {
    const c = new BatchStub(() => Promise.reject(new DataplaneError("invalid_argument", 'json: unknown field "paths"')), files);
    assert.deepEqual(answers(await new BrokerSandbox(c).downloadFiles(["/a", "/b", "/c"])), want);
    assert.deepEqual(c.ops, ["tar", "download", "download", "download"]);
  });

  it("a hostile stream", async () => {
    const c = new BatchStub(async (sink) => {
      sink(archive(entry({ path: "evil" }, Buffer.from("E"))));
      return tree(1);
    }, files);
    assert.deepEqual(answers(await new BrokerSandbox(c).downloadFiles(["/a", "/b", "/c"])), want);
  });
});
