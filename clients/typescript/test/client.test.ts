// These tests run against a live mesh (tests/clients/test_ts_client.py starts
// one and sets the variables below); without it they skip.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Code, ConnectError, FinishReason, KvmeshClient, type GenerateRequestInit, type StreamEnd } from "../src/index.js";

const address = process.env.KVMESH_GATEWAY_ADDRESS;
const apiKey = process.env.KVMESH_API_KEY;
const metricsUrl = process.env.KVMESH_METRICS_URL;
const decodePid = Number(process.env.KVMESH_DECODE_PID);
const skip =
  address && apiKey && metricsUrl && decodePid
    ? false
    : "no mesh: set KVMESH_GATEWAY_ADDRESS, KVMESH_API_KEY, KVMESH_METRICS_URL and KVMESH_DECODE_PID (tests/clients/test_ts_client.py does)";

/** A greedy completion of exactly n tokens. */
function request(n: number): GenerateRequestInit {
  return {
    prompt: { case: "text", value: "the quick brown fox jumps over the lazy dog" },
    sampling: { temperature: 0, maxTokens: n, ignoreEos: true },
  };
}

/** The gateway's kvmesh_gateway_inflight_requests gauge. */
async function inflight(): Promise<number> {
  const text = await (await fetch(metricsUrl!)).text();
  const line = text.split("\n").find((l) => l.startsWith("kvmesh_gateway_inflight_requests "));
  assert.ok(line, `no kvmesh_gateway_inflight_requests in ${metricsUrl}`);
  return Number(line.split(" ")[1]);
}

/** Polls the gauge until it reads want; the bound only guards against hanging. */
async function waitInflight(want: number): Promise<void> {
  let got = NaN;
  for (const deadline = Date.now() + 30_000; Date.now() < deadline; await new Promise((r) => setTimeout(r, 50))) {
    got = await inflight();
    if (got === want) return;
  }
  assert.fail(`kvmesh_gateway_inflight_requests = ${got}, want ${want}`);
}

/**
 * Stops the mesh's decode worker (SIGSTOP) until the returned function resumes it, so a request sent
 * meanwhile stays in flight until the test aborts it: the test mesh's tiny model answers 400 tokens
 * faster than a loaded machine schedules an abort sent mid-stream.
 */
function holdDecode(): () => void {
  process.kill(decodePid, "SIGSTOP");
  return () => process.kill(decodePid, "SIGCONT");
}

describe("KvmeshClient against a mesh", { skip }, () => {
  let client: KvmeshClient;
  before(() => {
    client = new KvmeshClient({ address: address!, apiKey: apiKey! });
  });
  after(() => client.close());

  test("generate streams incrementally and ends with usage", async () => {
    let messages = 0;
    let tokens = 0;
    let end: StreamEnd | undefined;
    for await (const chunk of client.generate(request(24), { timeoutMs: 60_000 })) {
      assert.equal(end, undefined, "a chunk after the final one");
      assert.equal(chunk.offset, tokens, `chunk ${messages}: offset is not the tokens received so far`);
      messages++;
      tokens += chunk.tokenIds.length;
      end = chunk.final;
    }
    assert.ok(messages >= 2, `${messages} message(s): the tokens did not stream`);
    assert.ok(end, "the stream ended without a final chunk");
    assert.equal(tokens, 24);
    assert.equal(end.usage?.completionTokens, tokens);
    assert.equal(end.finishReason, FinishReason.LENGTH);
  });

  test("an aborted signal stops the stream and the gateway frees the request", async () => {
    await waitInflight(0);
    const resume = holdDecode();
    try {
      const abort = new AbortController();
      const consumed = assert.rejects(
        async () => {
          for await (const chunk of client.generate(request(400), { signal: abort.signal })) {
            assert.equal(chunk.final, undefined, "the generation finished before it was aborted");
          }
        },
        (err: unknown) => ConnectError.from(err).code === Code.Canceled,
      );
      // The request is running on the server (its decode is held): the gauge counts it.
      await waitInflight(1);
      abort.abort();
      await consumed;
      // The gateway frees the request without waiting for the held worker.
      await waitInflight(0);
    } finally {
      resume();
    }
  });

  test("a wrong API key is Unauthenticated", async () => {
    const wrong = new KvmeshClient({ address: address!, apiKey: `not-${apiKey}` });
    try {
      await assert.rejects(
        async () => {
          for await (const _ of wrong.generate(request(4))) {
            assert.fail("a chunk with a wrong key");
          }
        },
        (err: unknown) => ConnectError.from(err).code === Code.Unauthenticated,
      );
      await assert.rejects(wrong.tokenize("hello"), (err: unknown) => ConnectError.from(err).code === Code.Unauthenticated);
    } finally {
      wrong.close();
    }
  });

  test("tokenize, listModels and chat", async () => {
    const models = await client.listModels();
    assert.equal(models.length, 1);
    assert.ok(models[0]!.maxModelLen > 0);
    assert.ok((await client.tokenize("hello world")).length > 0);

    let tokens = 0;
    let end: StreamEnd | undefined;
    const chat = {
      model: models[0]!.id,
      messages: [{ role: "user", content: "hello" }],
      sampling: { temperature: 0, maxTokens: 8, ignoreEos: true },
    };
    for await (const chunk of client.chat(chat)) {
      tokens += chunk.tokenIds.length;
      end = chunk.final;
    }
    assert.equal(tokens, 8);
    assert.equal(end?.usage?.completionTokens, 8);
  });
});
