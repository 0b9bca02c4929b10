// A Node.js client of the IM service, over the wire: proves the protos are
// usable from another language with the stock gRPC libraries, loading the
// .proto at run time (no generated code). It signs in as programs do: a
// signed-in person creates a personal access token, and the program
// exchanges it for access tokens, sent as `authorization: Bearer`.
//
// Run by tests/e2e/test_node_client.py against a live server, or by hand:
//   IM_ADDRESS=127.0.0.1:50051 node --test tests/e2e/node/
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { call, imClients, invited, personalAccess, signUp } from './support.mjs';

const address = process.env.IM_ADDRESS;

describe('IMService from Node.js', { skip: address ? false : 'IM_ADDRESS is not set' }, () => {
  let client;
  let auth;
  let alice;
  let aliceToken;
  let bob;
  let bobToken;
  let group;
  let sent;

  before(async () => {
    ({ im: client, auth } = imClients(address));
    const signedUp = await signUp(client, 'Alice');
    alice = signedUp.creator;
    assert.equal(alice.workspace_id, signedUp.workspace.id);
    const program = await personalAccess(auth, signedUp.accessToken);
    assert.equal(program.member.id, alice.id);
    aliceToken = program.accessToken;
  });

  after(() => {
    client?.close();
    auth?.close();
  });

  test('a member creates another member in its workspace', async () => {
    const response = await call(
      client,
      'CreateMember',
      { kind: 'MEMBER_KIND_AGENT', display_name: 'Bot', request_id: randomUUID() },
      aliceToken,
    );
    assert.equal(response.member.workspace_id, alice.workspace_id);
    assert.equal(response.member.kind, 'MEMBER_KIND_AGENT');
  });

  test('an invited person joins and signs a program in with a personal access token', async () => {
    const joined = await invited(auth, aliceToken, 'Bob');
    const program = await personalAccess(auth, joined.accessToken);
    bob = program.member;
    bobToken = program.accessToken;
    assert.equal(bob.workspace_id, alice.workspace_id);
    assert.equal(bob.kind, 'MEMBER_KIND_HUMAN');
  });

  test('creates a group with the other member', async () => {
    const response = await call(
      client,
      'CreateGroup',
      { name: 'node e2e', member_ids: [bob.id], request_id: randomUUID() },
      aliceToken,
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
      aliceToken,
    );
    sent = response.message;
    assert.equal(sent.sender_id, alice.id);
    assert.equal(sent.group_id, group.id);
    assert.equal(sent.content_type, 'CONTENT_TYPE_TEXT');
  });

  test('the recipient sees it unread', async () => {
    const response = await call(client, 'GetAllUnread', {}, bobToken);
    const ids = response.messages.map((m) => m.id);
    assert.ok(ids.includes(sent.id), `unread ${JSON.stringify(ids)} lacks ${sent.id}`);
  });

  test('the recipient sees it in the history', async () => {
    const response = await call(client, 'ListMessages', { group_id: group.id }, bobToken);
    const found = response.messages.find((m) => m.id === sent.id);
    assert.ok(found, 'the message is missing from the history');
    assert.equal(found.content, 'hello from Node.js');
  });

  test("the recipient's chat list counts one unread message", async () => {
    const response = await call(client, 'ListChats', {}, bobToken);
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
      bobToken,
    );
    assert.equal(marked.read_state.unread_count, '0');
    assert.equal(marked.read_state.last_read_message_id, sent.id);

    const unread = await call(client, 'GetAllUnread', {}, bobToken);
    assert.deepEqual(unread.messages, []);
    const chats = await call(client, 'ListChats', {}, bobToken);
    assert.equal(chats.chats.find((c) => c.group.id === group.id).unread_count, '0');
  });

  test('a call without an access token is UNAUTHENTICATED', async () => {
    await assert.rejects(call(client, 'ListChats', {}), { code: grpc.status.UNAUTHENTICATED });
    // The retired x-member-id header names nobody any more.
    await assert.rejects(call(client, 'ListChats', {}, undefined, { 'x-member-id': bob.id }), (error) => {
      assert.equal(error.code, grpc.status.UNAUTHENTICATED);
      assert.match(error.details, /authorization: Bearer/);
      return true;
    });
  });
});
