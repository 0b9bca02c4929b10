"""The IM's use cases, one module per concern.

- `workspaces`, `members` (and agents' owners), `groups` (and who is in them),
  `messages`, `read_state`: messaging; each handler checks the caller's rights,
  changes state in one transaction together with the event describing the
  change, then signals it. They share `deps.Deps`.
- `auth` (sign-in, sessions, invites, roles), `machine_access` (tokens for
  programs), `oidc` (sign-in through an OpenID Connect provider), built on
  `auth_common`: identity.

Live event delivery (the event hub and the watch feed) is in
`services.im.service_layer.events`.
"""
