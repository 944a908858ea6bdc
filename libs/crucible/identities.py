"""Service identities: per service (and the operator), an NKey for the bus and an S3 key for the object
store, and what the servers need to hold each to its grants (`crucible.contracts.access`).

One folder per identity, so that a deployment mounts each service its own and nothing else:
- `<identity>/seed.nk` (0600), the bus credential (`CRUCIBLE_NATS_NKEY_FILE`). The server holds only
  the public keys, in `server/auth.conf` (nats-server's authorization), which carries no secret.
- `<identity>/s3.key` (0600), its S3 access key and secret key (`CRUCIBLE_S3_KEY_FILE`);
  `server/minio/<service>.json` is a service's grants as a MinIO policy. The operator's is the root key
  of a store the local stack runs; a deployment's store has its own root key.
Everything is made once per folder and kept: a stack started again on the same state keeps its
identities. `crucible up` writes them into its state folder; for compose and Kubernetes,
`crucible identities DIR` writes the same files for the deployment to mount.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import nkeys

from crucible.contracts.access import (
    ADMIN,
    ADMIN_PERMISSIONS,
    OBJECT_GRANTS,
    SERVICE_PERMISSIONS,
    Permissions,
    aws_policy,
)
from crucible.private import write_private

IDENTITIES: tuple[str, ...] = (*SERVICE_PERMISSIONS, ADMIN)
SEED = "seed.nk"
S3_KEY = "s3.key"
SERVER_CONFIG = "server/auth.conf"
"""The authorization block for nats-server, under the identities' folder (`include` it, or pass `-c`)."""


def permissions(identity: str) -> Permissions:
    if identity == ADMIN:
        return ADMIN_PERMISSIONS
    try:
        return SERVICE_PERMISSIONS[identity]
    except KeyError:
        raise ValueError(f"no bus identity {identity!r}; known: {', '.join(IDENTITIES)}") from None


def seed_file(folder: Path, identity: str) -> Path:
    permissions(identity)
    return folder / identity / SEED


def public_key(seed_path: Path) -> str:
    """The public key (U...) of the user seed in `seed_path`; a clear error for anything else."""
    try:
        pair = nkeys.from_seed(bytearray(seed_path.read_bytes().strip()))
        # nkeys is untyped: public_key is bytes, but inference also sees the VerifyKey it is derived from
        key = pair.public_key.decode()  # pyright: ignore[reportAttributeAccessIssue]
    except (OSError, nkeys.ErrInvalidSeed, ValueError) as exc:
        raise ValueError(f"{seed_path} holds no NKey user seed: {type(exc).__name__}") from None
    if not key.startswith("U"):
        raise ValueError(f"{seed_path} holds an NKey seed that is not a user's")
    return key


def s3_key_file(folder: Path, identity: str) -> Path:
    permissions(identity)
    return folder / identity / S3_KEY


def read_s3_key(path: Path) -> tuple[str, str]:
    """(access key, secret key) from an `s3.key` file: two lines."""
    lines = path.read_text().split()
    if len(lines) != 2:
        raise ValueError(f"{path} holds no S3 key: two lines, the access key and the secret key, expected")
    return lines[0], lines[1]


def ensure_identities(folder: Path) -> dict[str, str]:
    """Every identity's seed and S3 key in `folder` (made where missing, mode 0600): identity -> its NKey's
    public key."""
    keys = {}
    for identity in IDENTITIES:
        path = seed_file(folder, identity)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            write_private(path, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode())
        keys[identity] = public_key(path)
        if not s3_key_file(folder, identity).exists():
            write_private(s3_key_file(folder, identity), f"crucible-{identity}\n{secrets.token_hex(24)}")
    return keys


def s3_keys(folder: Path) -> dict[str, tuple[str, str]]:
    """Each service's S3 key in `folder` (made where missing)."""
    ensure_identities(folder)
    return {service: read_s3_key(s3_key_file(folder, service)) for service in OBJECT_GRANTS}


def authorization(keys: dict[str, str]) -> dict[str, object]:
    """The nats-server `authorization` block: each public key with its identity's permissions."""
    users = [{"nkey": key, "permissions": permissions(identity).config()} for identity, key in keys.items()]
    return {"authorization": {"users": users}}


def write_server_config(folder: Path, *, bucket: str = "crucible") -> Path:
    """Every identity in `folder`, `server/auth.conf` (JSON, which nats-server reads as its own format) and
    each service's MinIO policy for `bucket` (`server/minio/<service>.json`): returns the file to give
    nats-server."""
    path = folder / SERVER_CONFIG
    (path.parent / "minio").mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(authorization(ensure_identities(folder)), indent=2) + "\n")
    for service in OBJECT_GRANTS:
        (path.parent / "minio" / f"{service}.json").write_text(
            json.dumps(aws_policy(service, bucket), indent=2) + "\n"
        )
    return path
