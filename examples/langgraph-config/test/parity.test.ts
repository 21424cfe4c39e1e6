// Same answers as deepagents' own backends: each case runs on this backend (a real broker's
// sandbox) and on deepagents' LocalShellBackend (a temporary directory), and the answers must
// agree. The README lists where this backend is deliberately stricter.

import assert from "node:assert/strict";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { LocalShellBackend } from "deepagents";
import { BrokerSandbox } from "../src/backend.js";
import { startBroker, type Broker } from "./helpers/broker.js";

let broker: Broker;
let ours: BrokerSandbox;
let theirs: LocalShellBackend;
let dir: string;

before(async () => {
  broker = await startBroker();
  await broker.create("parity");
  ours = BrokerSandbox.dedicated(await broker.block("parity", "--expires", "10m"));
  dir = await mkdtemp(join(tmpdir(), "sbx-parity-"));
  theirs = new LocalShellBackend({ rootDir: dir, virtualMode: true });
  for (const b of [ours, theirs]) {
    for (const [p, c] of [["/a.ts", "TODO a\n"], ["/b.js", "TODO b\n"], ["/c.py", "TODO c\n"], ["/src/d.ts", "TODO d\n"], ["/empty.txt", ""]]) {
      const w = await b.write(p!, c!);
      assert.equal(w.error, undefined, `${b === ours ? "ours" : "theirs"}: write ${p}: ${w.error}`);
    }
  }
});

after(async () => {
  ours?.close();
  await broker?.stop();
  if (dir) await rm(dir, { recursive: true, force: true });
});

describe("parity with deepagents' LocalShellBackend", { timeout: 60_000 }, () => {
  it("glob expands brace patterns", async () => {
    for (const pattern of ["*.{ts,js}", "**/*.{ts,py}", "{src,nope}/*.ts"]) {
      const [a, b] = await Promise.all([ours.glob(pattern, "/"), theirs.glob(pattern, "/")]);
      const names = (r: typeof a) => (r.files ?? []).map((f) => f.path).sort();
      assert.ok(names(b).length > 0, `deepagents finds nothing for ${pattern}`);
      assert.deepEqual(names(a), names(b), pattern);
    }
  });

  it("grep's glob filter expands brace patterns", async () => {
    const [a, b] = await Promise.all([ours.grep("TODO", "/", "*.{ts,js}"), theirs.grep("TODO", "/", "*.{ts,js}")]);
    const lines = (r: typeof a) => (r.matches ?? []).map((m) => `${m.path}:${m.line}:${m.text}`).sort();
    assert.ok(lines(b).length > 0);
    assert.deepEqual(lines(a), lines(b));
  });

  it("an edit of an empty file reports 0 replacements", async () => {
    const [a, b] = await Promise.all([ours.edit("/empty.txt", "", "now full\n"), theirs.edit("/empty.txt", "", "now full\n")]);
    assert.equal(b.occurrences, 0);
    assert.equal(a.error, undefined);
    assert.equal(a.occurrences, b.occurrences);
    assert.equal((await ours.read("/empty.txt")).content, "now full");
  });

  it("invalid UTF-8 in command output: one replacement character per bad byte", async () => {
    const cmd = String.raw`printf 'a\377\376b\342\202c\n'`;
    const [a, b] = await Promise.all([ours.execute(cmd), theirs.execute(cmd)]);
    assert.equal(b.output, "a\uFFFD\uFFFDb\uFFFDc\n");
    assert.equal(a.output, b.output);
    assert.equal(a.exitCode, 0);
  });
});
