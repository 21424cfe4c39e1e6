// Follows a sandbox's event stream: GET /v1/sandboxes/{ref}/events (SSE, owner API key). Each event
// is `event: sandbox` with a JSON data line: {type, sandbox_id, path?, command?, exit_code?, ...}.

export interface SandboxEvent {
  id?: string;
  type: string;
  sandbox_id: string;
  path?: string;
  command?: string;
  exit_code?: number;
  jti?: string;
  [k: string]: unknown;
}

export interface EventStream {
  /** False when the broker has no events route (the stream is not built yet): nothing to check. */
  available: boolean;
  /** Why it is not available. */
  reason?: string;
  events: SandboxEvent[];
  /** Waits until pred holds for the events seen so far. */
  waitFor(pred: (events: SandboxEvent[]) => boolean, timeoutMs?: number): Promise<SandboxEvent[]>;
  close(): void;
}

/** Subscribes to a sandbox's events; call before the actions you want to see. */
export async function followEvents(brokerURL: string, apiKey: string, ref: string): Promise<EventStream> {
  const ac = new AbortController();
  const events: SandboxEvent[] = [];
  const waiters = new Set<() => void>();
  let res: Response;
  try {
    res = await fetch(`${brokerURL}/v1/sandboxes/${encodeURIComponent(ref)}/events`, {
      headers: { Authorization: `Bearer ${apiKey}`, Accept: "text/event-stream" },
      signal: ac.signal,
    });
  } catch (e) {
    return unavailable(`the events stream could not be opened: ${(e as Error).message}`);
  }
  if (res.status === 404) {
    const body = await res.text();
    if (body.includes("route_not_found")) return unavailable(`the broker has no events route yet (${body.trim()})`);
    throw new Error(`events: 404 ${body}`);
  }
  if (res.status !== 200 || !res.body) throw new Error(`events: ${res.status} ${await res.text()}`);

  (async () => {
    const decoder = new TextDecoder();
    let buf = "";
    let data: string[] = [];
    let id: string | undefined;
    try {
      for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
        buf += decoder.decode(chunk, { stream: true });
        let nl: number;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl).replace(/\r$/, "");
          buf = buf.slice(nl + 1);
          if (line === "") {
            if (data.length) {
              try {
                const ev = JSON.parse(data.join("\n")) as SandboxEvent;
                if (id && !ev.id) ev.id = id;
                events.push(ev);
                for (const w of waiters) w();
              } catch {
                // not JSON: a comment or keep-alive
              }
            }
            data = [];
            id = undefined;
          } else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          else if (line.startsWith("id:")) id = line.slice(3).trim();
        }
      }
    } catch {
      // closed
    }
  })();

  return {
    available: true,
    events,
    waitFor(pred, timeoutMs = 10_000) {
      return new Promise((resolve, reject) => {
        const check = () => {
          if (pred(events)) {
            waiters.delete(check);
            clearTimeout(timer);
            resolve(events);
          }
        };
        const timer = setTimeout(() => {
          waiters.delete(check);
          reject(new Error(`events: timed out; saw ${JSON.stringify(events.map((e) => [e.type, e.path ?? e.command ?? ""]))}`));
        }, timeoutMs);
        waiters.add(check);
        check();
      });
    },
    close: () => ac.abort(),
  };

  function unavailable(reason: string): EventStream {
    return {
      available: false,
      reason,
      events,
      waitFor: () => Promise.reject(new Error(reason)),
      close: () => ac.abort(),
    };
  }
}
