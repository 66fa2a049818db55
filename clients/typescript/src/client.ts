import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import {
  type ChatResponse,
  ChatRequestSchema,
  GatewayService,
  type GenerateResponse,
  GenerateRequestSchema,
  type ModelInfo,
  TokenizeRequestSchema,
} from "./gen/kvmesh/api/gateway/v1/gateway_pb.js";

/** A GenerateRequest as a plain object (or a message made with `create`). */
export type GenerateRequestInit = MessageInitShape<typeof GenerateRequestSchema>;
/** A ChatRequest as a plain object (or a message made with `create`). */
export type ChatRequestInit = MessageInitShape<typeof ChatRequestSchema>;

export interface KvmeshClientOptions {
  /** The gateway's gRPC address: "host:port" (plaintext) or an http:// or https:// URL. */
  address: string;
  /** Sent as "authorization: Bearer <key>" with every call. */
  apiKey?: string;
}

export interface CallOptions {
  /** Aborting cancels the call: a stream stops and the gateway stops generating. */
  signal?: AbortSignal;
  /** A deadline for the whole call, sent to the server as grpc-timeout. */
  timeoutMs?: number;
}

/**
 * A client for kvmesh's public gRPC API (kvmesh.api.gateway.v1.GatewayService),
 * over @connectrpc/connect-node's gRPC (HTTP/2) transport.
 *
 * Errors are ConnectErrors whose `code` is the gRPC status code
 * (e.g. Code.Unauthenticated for a wrong API key).
 */
export class KvmeshClient {
  /** The generated client, for what this class does not wrap. */
  readonly api: Client<typeof GatewayService>;
  private readonly sessions: Http2SessionManager;

  constructor(options: KvmeshClientOptions) {
    const baseUrl = /^https?:\/\//.test(options.address) ? options.address : `http://${options.address}`;
    // Our own session manager, so that close() can end the HTTP/2 connection
    // (an open one would keep the Node process alive).
    this.sessions = new Http2SessionManager(baseUrl);
    const interceptors = options.apiKey === undefined ? [] : [bearer(options.apiKey)];
    const transport = createGrpcTransport({ baseUrl, sessionManager: this.sessions, interceptors });
    this.api = createClient(GatewayService, transport);
  }

  /**
   * Completes a prompt, yielding chunks as the gateway sends them; the last
   * carries `final` (finish reason, usage, timings). Leaving a `for await`
   * loop early cancels the call too.
   */
  generate(request: GenerateRequestInit, options: CallOptions = {}): AsyncIterable<GenerateResponse> {
    return this.api.generate(create(GenerateRequestSchema, request), options);
  }

  /** Completes a conversation (the model's chat template is applied), streaming like generate(). */
  chat(request: ChatRequestInit, options: CallOptions = {}): AsyncIterable<ChatResponse> {
    return this.api.chat(create(ChatRequestSchema, request), options);
  }

  /** The token ids of `text` under the served model's tokenizer, special tokens (e.g. BOS) added. */
  async tokenize(text: string, options: CallOptions = {}): Promise<number[]> {
    const request = create(TokenizeRequestSchema, {
      input: { case: "text", value: text },
      addSpecialTokens: true,
    });
    return (await this.api.tokenize(request, options)).tokenIds;
  }

  /** The models the gateway serves. */
  async listModels(options: CallOptions = {}): Promise<ModelInfo[]> {
    return (await this.api.listModels({}, options)).models;
  }

  /** Closes the connection; calls in flight fail. */
  close(): void {
    this.sessions.abort();
  }
}

function bearer(apiKey: string): Interceptor {
  return (next) => (req) => {
    req.header.set("authorization", `Bearer ${apiKey}`);
    return next(req);
  };
}
