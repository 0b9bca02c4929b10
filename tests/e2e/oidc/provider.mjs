// A real OpenID Connect provider for the tests (npm's oidc-provider), on a
// free loopback port.
//
// It prints {"issuer": "http://127.0.0.1:<port>"} once it listens, then
// reads one JSON line from stdin, {"redirect_uris": [...]} (the gateway's
// callback: its port is known only after the gateway has started, and the
// gateway needs the issuer first), configures its clients with them and
// prints {"ready": true}. It exits when stdin closes (the test ended).
//
// Clients: OIDC_TEST_CLIENT_ID / OIDC_TEST_CLIENT_SECRET (client_secret_basic,
// authorization code only, PKCE required), and "other-client" (same
// secret), whose tokens are for another audience.
//
// Accounts: the development interactions ask for a login and a password
// (any password). The login is the account id and its email; a login that
// starts with "unverified" has email_verified false, one that starts with
// "noemail" has no email at all.

import http from 'node:http';
import readline from 'node:readline';

import Provider from 'oidc-provider';

const clientId = process.env.OIDC_TEST_CLIENT_ID || 'agentim-test-client';
const clientSecret = process.env.OIDC_TEST_CLIENT_SECRET || 'agentim-test-secret';

function account(id) {
  const claims = { sub: id, name: `Person ${id.split('@')[0]}` };
  if (!id.startsWith('noemail')) {
    claims.email = id;
    claims.email_verified = !id.startsWith('unverified');
  }
  return { accountId: id, async claims() { return claims; } };
}

function configuration(redirectUris) {
  const client = (id) => ({
    client_id: id,
    client_secret: clientSecret,
    redirect_uris: redirectUris,
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  });
  return {
    clients: [client(clientId), client('other-client')],
    // Every client must use PKCE (oidc-provider accepts S256 only).
    pkce: { required: () => true },
    // The email claims go in the ID token itself (not only to userinfo):
    // the IM sees the ID token alone.
    conformIdTokenClaims: false,
    claims: { openid: ['sub'], email: ['email', 'email_verified'], profile: ['name'] },
    findAccount: async (ctx, id) => account(id),
    cookies: { keys: ['agentim-test-cookie-key'] },
    features: { devInteractions: { enabled: true } },
  };
}

let handle = (request, response) => {
  response.statusCode = 503;
  response.end('not configured yet');
};
const server = http.createServer((request, response) => handle(request, response));
server.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  const issuer = `http://127.0.0.1:${port}`;
  const input = readline.createInterface({ input: process.stdin });
  input.once('line', (line) => {
    const { redirect_uris: redirectUris } = JSON.parse(line);
    const provider = new Provider(issuer, configuration(redirectUris));
    handle = provider.callback();
    process.stdout.write(`${JSON.stringify({ ready: true })}\n`);
  });
  input.on('close', () => process.exit(0));
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});
