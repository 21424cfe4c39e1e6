// uploadFiles in one tar stream (the dataplane's untar): the archive GNU tar reads back, and on a
// real broker the same files as deepagents' LocalShellBackend, in one synced event; a file the
// tar cannot carry still gets its own answer.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { LocalShellBackend } from "deepagents";
import { BrokerSandbox } from "../src/backend.js";
import { tarFiles } from "../src/trees.js";
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
    const synced = (await broker.sbctl("events", "trees", "-o", "json", "--backlog", "200"))
      .trim().split("\n").map((l) => JSON.parse(l)).filter((e) => e.type === "synced");
    assert.equal(synced.length, 1, "one tar stream, one synced event");
    assert.equal(synced[0].files, 4);
  });

  it("a file the tar cannot carry gets its own answer, the others are written", async () => {
    const r = await ours.uploadFiles([["/ok.txt", new TextEncoder().encode("ok\n")], ["/dir/../../escape", new Uint8Array(1)]]);
    assert.equal(r[0]!.error, null);
    assert.notEqual(r[1]!.error, null);
    const d = await ours.downloadFiles(["/ok.txt"]);
    assert.equal(Buffer.from(d[0]!.content!).toString(), "ok\n");
  });
});
