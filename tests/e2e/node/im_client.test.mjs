// A Node.js client of the IM service, over the wire: proves the protos are
// usable from another language with the stock gRPC libraries, loading the
// .proto at run time (no generated code).
//
// Run by tests/e2e/test_node_client.py against a live server, or by hand:
//   IM_ADDRESS=127.0.0.1:50051 node --test tests/e2e/node/
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { createRequire } from 'node:module';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const protosDir = path.resolve(here, '..', '..', '..', 'protos');
// proto-loader parses with protobufjs, which ships google/protobuf/*.proto.
const googleProtosDir = path.dirname(require.resolve('protobufjs/package.json'));

const address = process.env.IM_ADDRESS;
const DEADLINE_MS = 5000;

function loadIMService() {
  const definition = protoLoader.loadSync('agentim/im/v1/im.proto', {
    includeDirs: [protosDir, googleProtosDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).agentim.im.v1.IMService;
}

/** Calls a unary method, as `memberId` when given, with a deadline. */
function call(client, method, request, memberId) {
  const metadata = new grpc.Metadata();
  if (memberId) {
    metadata.set('x-member-id', memberId);
  }
  const deadline = new Date(Date.now() + DEADLINE_MS);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (error, response) => {
      if (error) {
        reject(error);
      } else {
        resolve(response);
      }
    });
  });
}

describe('IMService from Node.js', { skip: address ? false : 'IM_ADDRESS is not set' }, () => {
  let client;
  let alice;
  let bob;
  let group;
  let sent;

  before(async () => {
    const IMService = loadIMService();
    client = new IMService(address, grpc.credentials.createInsecure());
    const created = await call(client, 'CreateWorkspace', {
      name: `node-e2e-${randomUUID()}`,
      creator_display_name: 'Alice',
      request_id: randomUUID(),
    });
    alice = created.creator;
    assert.equal(alice.workspace_id, created.workspace.id);
  });

  after(() => {
    client?.close();
  });

  test('a member creates another member in its workspace', async () => {
    const response = await call(
      client,
      'CreateMember',
      { kind: 'MEMBER_KIND_AGENT', display_name: 'Bob', request_id: randomUUID() },
      alice.id,
    );
    bob = response.member;
    assert.equal(bob.workspace_id, alice.workspace_id);
    assert.equal(bob.kind, 'MEMBER_KIND_AGENT');
  });

  test('creates a group with the other member', async () => {
    const response = await call(
      client,
      'CreateGroup',
      { name: 'node e2e', member_ids: [bob.id], request_id: randomUUID() },
      alice.id,
    );
    group = response.group;
    assert.equal(group.kind, 'GROUP_KIND_GROUP');
    assert.deepEqual([...group.member_ids].sort(), [alice.id, bob.id].sort());
  });

  test('sends a message', async () => {
    const response = await call(
      client,
      'SendMessage',
      { group_id: group.id, content: 'hello from Node.js', request_id: randomUUID() },
      alice.id,
    );
    sent = response.message;
    assert.equal(sent.sender_id, alice.id);
    assert.equal(sent.group_id, group.id);
    assert.equal(sent.content_type, 'CONTENT_TYPE_TEXT');
  });

  test('the recipient sees it unread', async () => {
    const response = await call(client, 'GetAllUnread', {}, bob.id);
    const ids = response.messages.map((m) => m.id);
    assert.ok(ids.includes(sent.id), `unread ${JSON.stringify(ids)} lacks ${sent.id}`);
  });

  test('the recipient sees it in the history', async () => {
    const response = await call(client, 'ListMessages', { group_id: group.id }, bob.id);
    const found = response.messages.find((m) => m.id === sent.id);
    assert.ok(found, 'the message is missing from the history');
    assert.equal(found.content, 'hello from Node.js');
  });

  test("the recipient's chat list counts one unread message", async () => {
    const response = await call(client, 'ListChats', {}, bob.id);
    const chat = response.chats.find((c) => c.group.id === group.id);
    assert.ok(chat, 'the group is missing from the chat list');
    assert.equal(chat.unread_count, '1');
    assert.equal(chat.last_message.id, sent.id);
  });

  test('MarkRead leaves nothing unread', async () => {
    const marked = await call(
      client,
      'MarkRead',
      { group_id: group.id, up_to_message_id: sent.id },
      bob.id,
    );
    assert.equal(marked.read_state.unread_count, '0');
    assert.equal(marked.read_state.last_read_message_id, sent.id);

    const unread = await call(client, 'GetAllUnread', {}, bob.id);
    assert.deepEqual(unread.messages, []);
    const chats = await call(client, 'ListChats', {}, bob.id);
    assert.equal(chats.chats.find((c) => c.group.id === group.id).unread_count, '0');
  });

  test('a call that names no member is UNAUTHENTICATED', async () => {
    await assert.rejects(call(client, 'ListChats', {}), { code: grpc.status.UNAUTHENTICATED });
  });
});
