// A real OpenID Connect provider for the browser tier: panva's oidc-provider (certified by the
// OpenID Foundation), with one confidential client for the portal (authorization code, PKCE
// required) and the test's users. Its login page is the provider's own (devInteractions), which
// here checks each user's password.
//
//   node provider.mjs PORT CONFIG.json     (CONFIG: {client_id, client_secret, redirect_uri, users})
//   users: {"alice": {"password": "...", "preferred_username": "alice@example.org"}, ...}
import fs from 'node:fs';
import Provider from 'oidc-provider';

const [port, configPath] = process.argv.slice(2);
const config = JSON.parse(fs.readFileSync(configPath, 'utf8'));
const users = config.users;

const provider = new Provider(`http://127.0.0.1:${port}`, {
  clients: [{
    client_id: config.client_id,
    client_secret: config.client_secret,
    redirect_uris: [config.redirect_uri],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  pkce: { required: () => true },
  claims: { openid: ['sub'], profile: ['preferred_username', 'name'] },
  scopes: ['openid', 'profile'],
  features: { devInteractions: { enabled: true } },
  cookies: { keys: [config.cookie_key] },
  ttl: { IdToken: 300, AccessToken: 300, AuthorizationCode: 60, Session: 3600, Interaction: 600, Grant: 3600 },
  async loadExistingGrant(ctx) {      // first-party client: no consent screen
    const grant = new provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope('openid profile');
    await grant.save();
    return grant;
  },
  async findAccount(ctx, id) {
    if (!Object.hasOwn(users, id)) return undefined;
    return { accountId: id, async claims() { return { sub: id, ...users[id].claims }; } };
  },
});

// devInteractions takes any login: refuse an unknown user or a wrong password before it does
// (the body read here is handed on: the provider parses req.body once the stream is consumed)
provider.use(async (ctx, next) => {
  if (ctx.method === 'POST' && /^\/interaction\/[^/]+$/.test(ctx.path)) {
    const raw = await new Promise((resolve, reject) => {
      let data = '';
      ctx.req.setEncoding('utf8');
      ctx.req.on('data', (c) => { data += c; });
      ctx.req.on('end', () => resolve(data));
      ctx.req.on('error', reject);
    });
    const body = new URLSearchParams(raw);
    const login = body.get('login');
    if (body.get('prompt') === 'login'
        && (!Object.hasOwn(users, login) || users[login].password !== body.get('password'))) {
      ctx.status = 403;
      ctx.body = 'wrong username or password';
      return;
    }
    ctx.req.body = raw;
  }
  await next();
});

provider.listen(Number(port), '127.0.0.1', () => { console.log(`oidc provider ready on ${port}`); });
