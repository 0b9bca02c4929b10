// A Node.js client of the runtime service, over the wire: the runtime protos
// (agent control included) used from another language, loaded at run time.
// It calls with a personal access token's access token, which the runtime
// verifies with the IM's public keys.
//
// Run by tests/e2e/test_node_client.py with IM_ADDRESS and RUNTIME_ADDRESS.
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { call, imClients, load, personalAccess, signUp } from './support.mjs';

const imAddress = process.env.IM_ADDRESS;
const runtimeAddress = process.env.RUNTIME_ADDRESS;

const skip = imAddress && runtimeAddress ? false : 'IM_ADDRESS or RUNTIME_ADDRESS is not set';

describe('RuntimeService from Node.js', { skip }, () => {
  let im;
  let auth;
  let runtime;
  let person;
  let agent;

  before(async () => {
    ({ im, auth } = imClients(imAddress));
    const Runtime = load('agentim/runtime/v1/runtime.proto').runtime.v1.RuntimeService;
    runtime = new Runtime(runtimeAddress, grpc.credentials.createInsecure());
    const signedUp = await signUp(im, 'Ada');
    person = (await personalAccess(auth, signedUp.accessToken)).accessToken;
  });

  after(() => {
    im?.close();
    auth?.close();
    runtime?.close();
  });

  test('a call without an access token is UNAUTHENTICATED', async () => {
    await assert.rejects(call(runtime, 'ListAgents', {}), { code: grpc.status.UNAUTHENTICATED });
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
