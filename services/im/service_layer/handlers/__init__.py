"""The IM's use cases, one module per concern.

- `workspaces`, `members` (and agents' owners), `groups` (and who is in
  them), `messages`, `read_state`: messaging. Each handler checks the
  caller's rights, changes state in one transaction together with the event
  describing the change, then signals it. They share `deps.Deps`.
- `sessions` (signing in with a password, refreshing, signing out,
  changing the password), `invites`, `roles`, `machine_access` (tokens for
  programs), `oidc` (signing in through an OpenID Connect provider),
  `audit_events` (the audit log, read): identity. They share
  `auth_deps.AuthDeps` and the blocks in `auth_deps` (issuing tokens and
  sessions, audit records, counting guesses, joining with an invite).
  `workspaces.create_workspace` uses them too, for the owner's account.

A handler of a command (`services.im.domain.commands`) takes its
dependencies and the command, and is reached through the message bus
(`services.im.service_layer.messagebus`, wired in `services.im.bootstrap`).
Queries change nothing and are plain functions the servicers call directly.

Live event delivery (the event hub and the watch feed) is in
`services.im.service_layer.events`.
"""
