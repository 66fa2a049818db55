export { KvmeshClient, type CallOptions, type ChatRequestInit, type GenerateRequestInit, type KvmeshClientOptions } from "./client.js";
export { Code, ConnectError } from "@connectrpc/connect";
export * from "./gen/kvmesh/api/gateway/v1/gateway_pb.js";
export * from "./gen/kvmesh/api/common/v1/accounting_pb.js";
export * from "./gen/kvmesh/api/common/v1/sampling_pb.js";
