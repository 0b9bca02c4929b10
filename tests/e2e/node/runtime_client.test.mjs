// A Node.js client of the runtime service, over the wire: the runtime protos
// (agent control included) used from another language, loaded at run time.
//
// Run by tests/e2e/test_node_client.py with IM_ADDRESS and RUNTIME_ADDRESS.
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { createRequire } from 'node:module';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const protosDir = path.resolve(here, '..', '..', '..', 'protos');
const googleProtosDir = path.dirname(require.resolve('protobufjs/package.json'));

const imAddress = process.env.IM_ADDRESS;
const runtimeAddress = process.env.RUNTIME_ADDRESS;
const DEADLINE_MS = 5000;

function load(file) {
  const definition = protoLoader.loadSync(file, {
    includeDirs: [protosDir, googleProtosDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).agentim;
}

function call(client, method, request, memberId) {
  const metadata = new grpc.Metadata();
  if (memberId) {
    metadata.set('x-member-id', memberId);
  }
  const deadline = new Date(Date.now() + DEADLINE_MS);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (error, response) =>
      error ? reject(error) : resolve(response),
    );
  });
}

const skip = imAddress && runtimeAddress ? false : 'IM_ADDRESS or RUNTIME_ADDRESS is not set';

describe('RuntimeService from Node.js', { skip }, () => {
  let im;
  let runtime;
  let person;
  let agent;

  before(async () => {
    im = new (load('agentim/im/v1/im.proto').im.v1.IMService)(imAddress, grpc.credentials.createInsecure());
    const Runtime = load('agentim/runtime/v1/runtime.proto').runtime.v1.RuntimeService;
    runtime = new Runtime(runtimeAddress, grpc.credentials.createInsecure());
    const created = await call(im, 'CreateWorkspace', {
      name: `node-runtime-${randomUUID()}`,
      creator_display_name: 'Ada',
    });
    person = created.creator.id;
  });

  after(() => {
    im?.close();
    runtime?.close();
  });

  test('creates an agent and pauses it', async () => {
    agent = (await call(runtime, 'CreateAgent', { name: 'helper' }, person)).agent;
    assert.equal(agent.state, 'AGENT_STATE_IDLE');
    const paused = await call(runtime, 'PauseAgent', { agent_id: agent.id }, person);
    assert.equal(paused.agent.state, 'AGENT_STATE_PAUSED');
  });

  test('an invalid control is FAILED_PRECONDITION with a readable message', async () => {
    await assert.rejects(call(runtime, 'StartAgent', { agent_id: agent.id }, person), (error) => {
      assert.equal(error.code, grpc.status.FAILED_PRECONDITION);
      assert.match(error.details, /cannot start an agent that is PAUSED/);
      return true;
    });
  });

  test('a task submitted twice with one request id is one task, run once resumed', async () => {
    const request = { agent_id: agent.id, input: 'say hello', request_id: 'node-1' };
    const first = (await call(runtime, 'SubmitTask', request, person)).task;
    const again = (await call(runtime, 'SubmitTask', request, person)).task;
    assert.equal(again.id, first.id);
    assert.equal(first.status, 'TASK_STATUS_QUEUED');
    await call(runtime, 'ResumeAgent', { agent_id: agent.id }, person);
    let task = first;
    for (let i = 0; i < 100 && task.status !== 'TASK_STATUS_SUCCEEDED'; i += 1) {
      await sleep(50);
      task = (await call(runtime, 'GetTask', { task_id: first.id }, person)).task;
    }
    assert.equal(task.status, 'TASK_STATUS_SUCCEEDED');
    assert.match(task.result, /say hello/);
  });
});
