"""Who may talk to the syncer: a credential on every call, and TLS when certificates are given.

The run secret stays with the syncer (and the operator). Each learner gets its own
credential, HMAC-SHA256(run secret, "learner:<id>") in hex (`learner_credential`): the
syncer derives every learner's and checks that the credential of a call belongs to the
learner the call names, so a learner can act only as itself. Holders of the run secret may
act as any learner (the operator's tools, tests). The evaluator process
(service.evaluate_on='evaluator') gets HMAC-SHA256(run secret, "evaluator"): it may read Θ
and the run's status as `EVALUATOR`, and never push, join or hold a lease.

A token never appears on a command line (where `ps` shows it to every user of the
machine): it comes from the environment variable DD_SYNCER_TOKEN or from the file
`service.token_file`. Calls carry it in the `x-dd-token` metadata entry and the server
compares in constant time.
"""

import hashlib
import hmac
import os
import ssl

import grpc

from decoupled_diloco.errors import ConfigError

TOKEN_ENV = "DD_SYNCER_TOKEN"
TOKEN_METADATA_KEY = "x-dd-token"
MIN_TOKEN_CHARS = 16


def call_metadata(token: str) -> tuple:
  """gRPC call metadata presenting `token`: the one way every caller (learners, benchmarks, attack tools) sends a
  credential, so the key cannot drift between them."""
  return ((TOKEN_METADATA_KEY, token),)


def load_token(token_file: str) -> str:
  """The shared secret: `service.token_file` if set, else $DD_SYNCER_TOKEN; ConfigError if neither."""
  if token_file:
    if not os.path.isfile(token_file):
      raise ConfigError(f"service.token_file {token_file!r} does not exist: point it at a file holding the token")
    with open(token_file, encoding="utf-8") as f:
      token = f.read().strip()
  else:
    token = os.environ.get(TOKEN_ENV, "").strip()
  if len(token) < MIN_TOKEN_CHARS:
    raise ConfigError(f"the syncer needs a shared token of at least {MIN_TOKEN_CHARS} characters: export "
                      f"{TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))') or set "
                      "--config.service.token_file")
  return token


ANY_LEARNER = -1  # What `caller` returns for the run secret: it may act as every learner.
EVALUATOR = -2  # What `caller` returns for the evaluator's credential, and the id its calls name: read-only.


def learner_credential(secret: str, learner: int) -> str:
  """Learner `learner`'s own credential, derived from the run secret (launchers hand it out instead of it).

  Why derived: the syncer needs no table of keys, and one learner's credential tells
  nothing about another's or about the secret.
  """
  return _derive(secret, f"learner:{learner}")


def evaluator_credential(secret: str) -> str:
  """The evaluator process's credential: reads Θ, cannot push (so a leaked one cannot steer the run)."""
  return _derive(secret, "evaluator")


def _derive(secret: str, role: str) -> str:
  return hmac.new(secret.encode(), role.encode(), hashlib.sha256).hexdigest()


class Credentials:
  """The syncer's check of who calls: the run secret, one learner's credential, or the evaluator's."""

  def __init__(self, secret: str, num_learners: int):
    self._keys = [(secret.encode(), ANY_LEARNER)]
    self._keys += [(learner_credential(secret, m).encode(), m) for m in range(num_learners)]
    self._keys.append((evaluator_credential(secret).encode(), EVALUATOR))

  def caller(self, metadata) -> int | None:
    """ANY_LEARNER for the run secret, a learner id for its credential, EVALUATOR for the evaluator's, None
    for anything else.

    Every key is compared (constant time each), so the timing tells nothing of which matched.
    """
    sent = str(dict(metadata or ()).get(TOKEN_METADATA_KEY, "")).encode()
    found = None
    for key, who in self._keys:
      if hmac.compare_digest(sent, key):
        found = who
    return found


def _read(path: str, what: str) -> bytes:
  if not os.path.isfile(path):
    raise ConfigError(f"{what} {path!r} does not exist: point --config.service.{what} at a PEM file")
  with open(path, "rb") as f:
    return f.read()


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
  """TLS credentials when both PEM files are given, None (plaintext) when neither is."""
  if bool(cert_file) != bool(key_file):
    raise ConfigError("TLS needs both --config.service.tls_cert and --config.service.tls_key (or neither)")
  if not cert_file:
    return None
  return grpc.ssl_server_credentials([(_read(key_file, "tls_key"), _read(cert_file, "tls_cert"))])


def channel_credentials(ca_file: str) -> grpc.ChannelCredentials | None:
  """TLS credentials trusting `ca_file` (e.g. the syncer's self-signed cert); None = plaintext."""
  if not ca_file:
    return None
  return grpc.ssl_channel_credentials(root_certificates=_read(ca_file, "tls_ca"))


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
  """The data channel's TLS (same PEM files as the gRPC server); None = plaintext."""
  if not cert_file:
    return None
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert_file, key_file)
  return context


def client_tls_context(ca_file: str) -> ssl.SSLContext | None:
  """A data-channel TLS context trusting `ca_file`, as `channel_credentials` does; None = plaintext."""
  if not ca_file:
    return None
  return ssl.create_default_context(cadata=_read(ca_file, "tls_ca").decode())
