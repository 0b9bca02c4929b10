"""The IM's use cases, one module per concern.

- `workspaces`, `members` (and agents' owners), `groups` (and who is in
  them), `messages`, `read_state`: messaging. Each handler checks the
  caller's rights, changes state in one transaction together with the event
  describing the change, then signals it. They share `deps.Deps`.
- `auth` (sign-in, sessions, invites, roles), `machine_access` (tokens for
  programs), `oidc` (sign-in through an OpenID Connect provider), built on
  `auth_common`: identity.

A handler of a command (`services.im.domain.commands`) takes its
dependencies and the command, and is reached through the message bus
(`services.im.service_layer.messagebus`, wired in `services.im.bootstrap`).
Queries change nothing and are plain functions the servicer calls directly;
so are the identity use cases, which the AuthService servicer calls as
methods.

Live event delivery (the event hub and the watch feed) is in
`services.im.service_layer.events`.
"""
