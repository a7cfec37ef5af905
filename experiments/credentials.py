r"""What launch_tpu hands out instead of the run secret: learner credentials and TLS certificates.

  python -m experiments.credentials learner --secret_file=F --learner=I --out=P
      learner I's credential (security.learner_credential of the secret in F; '-' = stdin),
      written 0600 to P: a learner host never stores the run secret.
  python -m experiments.credentials evaluator --secret_file=F --out=P
      the evaluator's read-only credential (security.evaluator_credential), likewise.
  python -m experiments.credentials certs --dir=D --host=IP_OR_NAME
      a self-signed CA (D/ca.pem + D/ca.key, made once and kept) and a certificate for the
      syncer naming HOST (D/syncer.pem + D/syncer.key), so that the syncer serves TLS by
      default: learners trust D/ca.pem, the CA's key never leaves this machine.

Bad input: one `error:` line, exit status 2.
"""

import argparse
import datetime
import ipaddress
import os
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from decoupled_diloco.service import security

VALID_DAYS = 365


def _write_private(path: str, data: bytes) -> None:
  """Writes `data` readable by this user only (created 0600, replaced atomically)."""
  descriptor = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(descriptor, "wb") as f:
    f.write(data)
  os.replace(path + ".tmp", path)


def write_credential(credential: str, out: str) -> None:
  """A learner's or the evaluator's credential into `out` (0600)."""
  _write_private(out, (credential + "\n").encode())


def _key_pem(key) -> bytes:
  return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _certificate(subject: str, public_key, issuer: x509.Name, signer, *, ca: bool, host: str = "") -> x509.Certificate:
  now = datetime.datetime.now(datetime.timezone.utc)
  builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(
      NameOID.COMMON_NAME, subject)])).issuer_name(issuer).public_key(public_key).serial_number(
          x509.random_serial_number()).not_valid_before(now - datetime.timedelta(
              minutes=5)).not_valid_after(now + datetime.timedelta(VALID_DAYS)).add_extension(
                  x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
  if host:
    try:
      name = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
      name = x509.DNSName(host)
    builder = builder.add_extension(x509.SubjectAlternativeName([name]), critical=False)
  return builder.sign(signer, hashes.SHA256())


def make_certificates(directory: str, host: str) -> dict[str, str]:
  """The run's CA (kept if it exists) and a syncer certificate for `host`; returns the PEM paths."""
  os.makedirs(directory, mode=0o700, exist_ok=True)
  paths = {name: os.path.join(directory, name) for name in ("ca.pem", "ca.key", "syncer.pem", "syncer.key")}
  if os.path.exists(paths["ca.pem"]) and os.path.exists(paths["ca.key"]):
    with open(paths["ca.key"], "rb") as f:
      ca_key = serialization.load_pem_private_key(f.read(), None)
    with open(paths["ca.pem"], "rb") as f:
      ca = x509.load_pem_x509_certificate(f.read())
  else:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "decoupled_diloco run CA")])
    ca = _certificate("decoupled_diloco run CA", ca_key.public_key(), name, ca_key, ca=True)
    _write_private(paths["ca.key"], _key_pem(ca_key))
    _write_private(paths["ca.pem"], ca.public_bytes(serialization.Encoding.PEM))
  key = ec.generate_private_key(ec.SECP256R1())
  leaf = _certificate(host, key.public_key(), ca.subject, ca_key, ca=False, host=host)
  _write_private(paths["syncer.key"], _key_pem(key))
  _write_private(paths["syncer.pem"], leaf.public_bytes(serialization.Encoding.PEM))
  return paths


def main(argv: list[str]) -> int:
  """The command line (see the module doc)."""
  parser = argparse.ArgumentParser(prog="python -m experiments.credentials")
  commands = parser.add_subparsers(dest="command", required=True)
  learner = commands.add_parser("learner")
  learner.add_argument("--secret_file", required=True)
  learner.add_argument("--learner", type=int, required=True)
  learner.add_argument("--out", required=True)
  evaluator = commands.add_parser("evaluator")
  evaluator.add_argument("--secret_file", required=True)
  evaluator.add_argument("--out", required=True)
  certs = commands.add_parser("certs")
  certs.add_argument("--dir", required=True)
  certs.add_argument("--host", required=True)
  args = parser.parse_args(argv)
  if args.command in ("learner", "evaluator"):
    if args.secret_file != "-" and not os.path.isfile(args.secret_file):
      sys.stderr.write(f"error: --secret_file {args.secret_file!r} does not exist\n")
      return 2
    with (sys.stdin if args.secret_file == "-" else open(args.secret_file, encoding="utf-8")) as f:
      secret = f.read().strip()
    if len(secret) < security.MIN_TOKEN_CHARS or getattr(args, "learner", 0) < 0:
      sys.stderr.write(f"error: need a secret of at least {security.MIN_TOKEN_CHARS} characters and --learner >= 0\n")
      return 2
    write_credential(
        security.learner_credential(secret, args.learner)
        if args.command == "learner" else security.evaluator_credential(secret), args.out)
  else:
    if not args.host:
      sys.stderr.write("error: --host must name the syncer's IP address or DNS name\n")
      return 2
    make_certificates(args.dir, args.host)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
