// npm run bench: latency of deepagents' read_file, ls and grep tools on one real broker, through
// our native backend (one dataplane request per call) and through deepagents' BaseSandbox, which
// implements them by running find / awk / grep through execute (one process per call). Both use
// the same dataplane connection; only the backend differs. Prints p50 / p90 side by side.
//
//   npm run bench [-- --iterations 200]

import { performance } from "node:perf_hooks";
import { parseArgs } from "node:util";
import { BaseSandbox, createFilesystemMiddleware, type ExecuteResponse, type FileDownloadResponse, type FileUploadResponse } from "deepagents";
import { BrokerSandbox } from "../src/backend.js";
import { DataplaneClient } from "../src/dataplane.js";
import { startBroker } from "../test/helpers/broker.js";

const { values } = parseArgs({ options: { iterations: { type: "string", default: "200" }, warmup: { type: "string", default: "20" } } });
const N = Number(values.iterations);
const WARMUP = Number(values.warmup);

/** deepagents' execute-based sandbox on the same dataplane client: the baseline. */
class ExecSandbox extends BaseSandbox {
  readonly id: string;
  constructor(private readonly client: DataplaneClient) {
    super();
    this.id = client.sandboxId;
  }
  async execute(command: string): Promise<ExecuteResponse> {
    const r = await this.client.exec({ command, combined: true });
    return { output: r.output ?? "", exitCode: r.exit_code, truncated: r.truncated === true };
  }
  async uploadFiles(files: Array<[string, Uint8Array]>): Promise<FileUploadResponse[]> {
    return Promise.all(files.map(async ([path, bytes]) => (await this.client.upload(path, bytes), { path, error: null })));
  }
  async downloadFiles(paths: string[]): Promise<FileDownloadResponse[]> {
    return Promise.all(paths.map(async (path) => ({ path, content: new Uint8Array(await this.client.download(path)), error: null })));
  }
}

type Tool = { name: string; invoke(input: unknown): Promise<unknown> };

function toolsOf(backend: unknown): Record<string, Tool> {
  const mw = createFilesystemMiddleware({ backend: backend as never });
  return Object.fromEntries((mw.tools as unknown as Tool[]).map((t) => [t.name, t]));
}

function pct(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;
}

async function measure(tool: Tool, args: Record<string, unknown>): Promise<{ p50: number; p90: number; sample: string }> {
  let id = 0;
  const call = () => tool.invoke({ id: `b${++id}`, name: tool.name, args, type: "tool_call" });
  let sample = "";
  for (let i = 0; i < WARMUP; i++) sample = JSON.stringify(await call());
  const times: number[] = [];
  for (let i = 0; i < N; i++) {
    const t0 = performance.now();
    await call();
    times.push(performance.now() - t0);
  }
  times.sort((x, y) => x - y);
  return { p50: pct(times, 50), p90: pct(times, 90), sample };
}

const broker = await startBroker();
try {
  const sb = await broker.create("bench");
  const block = await broker.block("bench", "--expires", "30m");
  const client = new DataplaneClient({ url: block.dataplane_url, credential: block.credential, sandboxId: block.sandbox_id });
  await client.connect();

  // A small repository: 20 packages of 10 files of 120 lines, one 2000-line file, a wide directory.
  const line = (i: number, f: string) => `    value_${i} = compute("${f}", ${i})  # ${i % 50 === 0 ? "NEEDLE" : "filler"}`;
  const writes: Promise<unknown>[] = [];
  for (let p = 0; p < 20; p++) {
    for (let f = 0; f < 10; f++) {
      const name = `src/pkg${p}/mod${f}.py`;
      writes.push(client.write({ path: name, content: Array.from({ length: 120 }, (_, i) => line(i, name)).join("\n") + "\n" }));
    }
  }
  writes.push(client.write({ path: "big.py", content: Array.from({ length: 2000 }, (_, i) => line(i, "big.py")).join("\n") + "\n" }));
  for (let i = 0; i < 100; i++) writes.push(client.write({ path: `wide/file${String(i).padStart(3, "0")}.txt`, content: `${i}\n` }));
  await Promise.all(writes);

  const native = toolsOf(new BrokerSandbox(client));
  const viaExec = toolsOf(new ExecSandbox(client));
  const cases: Array<[string, string, Record<string, unknown>]> = [
    ["read_file", "read_file (100 lines at offset 500 of 2000)", { file_path: "/workspace/big.py", offset: 500, limit: 100 }],
    ["ls", "ls (directory of 100 files)", { path: "/workspace/wide" }],
    ["grep", "grep (literal, 201 files, 24,000 lines)", { pattern: "NEEDLE", path: "/workspace" }],
  ];
  console.log(`sandbox ${sb.id}; ${N} sequential calls per row after ${WARMUP} warm-up calls; milliseconds\n`);
  console.log(`${"tool".padEnd(46)} ${"native p50".padStart(10)} ${"p90".padStart(7)}   ${"execute-based p50".padStart(17)} ${"p90".padStart(7)}   p50 ratio   answer size (native / execute-based)`);
  for (const [name, label, args] of cases) {
    const a = await measure(native[name]!, args);
    const b = await measure(viaExec[name]!, args);
    if (/Error/.test(a.sample) || /Error/.test(b.sample)) console.log(`  (check: native ${a.sample.slice(0, 120)} / exec ${b.sample.slice(0, 120)})`);
    console.log(
      `${label.padEnd(46)} ${a.p50.toFixed(2).padStart(10)} ${a.p90.toFixed(2).padStart(7)}   ${b.p50.toFixed(2).padStart(17)} ${b.p90.toFixed(2).padStart(7)}   ${(b.p50 / a.p50).toFixed(1)}x`.padEnd(12) +
        `  ${a.sample.length} / ${b.sample.length} chars`,
    );
  }
  client.close();
} finally {
  await broker.stop();
}
