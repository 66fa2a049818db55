// Streams one completion from a kvmesh gateway to stdout.
//   npm run build && node dist/examples/generate.js [prompt]
// Environment: KVMESH_GATEWAY_ADDRESS (default 127.0.0.1:50051), KVMESH_API_KEY.
import { KvmeshClient } from "../src/index.js";

const client = new KvmeshClient({
  address: process.env.KVMESH_GATEWAY_ADDRESS ?? "127.0.0.1:50051",
  apiKey: process.env.KVMESH_API_KEY,
});

// Ctrl-C aborts the stream, and with it the generation on the server.
const abort = new AbortController();
process.once("SIGINT", () => abort.abort());

try {
  const request = {
    prompt: { case: "text" as const, value: process.argv[2] ?? "Hello" },
    sampling: { maxTokens: Number(process.env.MAX_TOKENS ?? 64), temperature: 0 },
  };
  for await (const chunk of client.generate(request, { signal: abort.signal })) {
    process.stdout.write(chunk.text);
    if (chunk.final) {
      const usage = chunk.final.usage;
      console.error(`\nprompt tokens: ${usage?.promptTokens}, completion tokens: ${usage?.completionTokens}`);
    }
  }
} finally {
  client.close();
}
