// What the Node.js clients share: the protos loaded at run time, unary calls
// with an access token, and signing in as a program does, with a personal
// access token (docs/security.md).
import { randomUUID } from 'node:crypto';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const protosDir = path.resolve(here, '..', '..', '..', 'protos');
// proto-loader parses with protobufjs, which ships google/protobuf/*.proto.
const googleProtosDir = path.dirname(require.resolve('protobufjs/package.json'));

export const DEADLINE_MS = 5000;
export const PASSWORD = 'correct horse battery';

/** The `agentim` package of a .proto file, loaded at run time (no generated code). */
export function load(file) {
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

/** Calls a unary method with a deadline, with `authorization: Bearer <accessToken>` when given. */
export function call(client, method, request, accessToken, extra = {}) {
  const metadata = new grpc.Metadata();
  if (accessToken) {
    metadata.set('authorization', `Bearer ${accessToken}`);
  }
  for (const [key, value] of Object.entries(extra)) {
    metadata.set(key, value);
  }
  const deadline = new Date(Date.now() + DEADLINE_MS);
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (error, response) =>
      error ? reject(error) : resolve(response),
    );
  });
}

/** The IM's IMService and AuthService clients at `address`. */
export function imClients(address) {
  const im = load('agentim/im/v1/im.proto').im.v1.IMService;
  const auth = load('agentim/im/v1/auth.proto').im.v1.AuthService;
  const credentials = grpc.credentials.createInsecure();
  return { im: new im(address, credentials), auth: new auth(address, credentials) };
}

/**
 * A program's access token for a signed-in person: the person creates a
 * personal access token (its secret is shown once), and the program
 * exchanges the secret for short-lived access tokens.
 */
export async function personalAccess(auth, signedIn, name = 'node client') {
  const made = await call(
    auth,
    'CreatePersonalToken',
    { name, scope: 'PERSONAL_TOKEN_SCOPE_WRITE', request_id: randomUUID() },
    signedIn,
  );
  const exchanged = await call(auth, 'ExchangePersonalToken', { secret: made.secret });
  return { accessToken: exchanged.access_token, member: exchanged.member };
}

/** A new workspace whose creator has an account, signed in: `{ workspace, creator, accessToken }`. */
export async function signUp(im, name) {
  const login = `${name.toLowerCase()}-${randomUUID().slice(0, 8)}`;
  const created = await call(im, 'CreateWorkspace', {
    name: `node-${randomUUID()}`,
    creator_display_name: name,
    creator_login: login,
    creator_password: PASSWORD,
    request_id: randomUUID(),
  });
  return { workspace: created.workspace, creator: created.creator, accessToken: created.tokens.access_token };
}

/** A person `inviter` invites, who accepts with an account of their own: `{ member, accessToken }`. */
export async function invited(auth, inviter, name) {
  const invite = await call(auth, 'CreateInvite', { request_id: randomUUID() }, inviter);
  const accepted = await call(auth, 'AcceptInvite', {
    invite: invite.secret,
    display_name: name,
    login: `${name.toLowerCase()}-${randomUUID().slice(0, 8)}`,
    password: PASSWORD,
    request_id: randomUUID(),
  });
  return { member: accepted.tokens.member, accessToken: accepted.tokens.access_token };
}
