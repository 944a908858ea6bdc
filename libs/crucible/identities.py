"""Bus identities: an NKey per service (and one for the operator), and the nats-server authorization
that holds each to its permissions (`crucible.contracts.access`).

A seed file (`<identity>/seed.nk`, mode 0600, one folder per identity so that a deployment can mount
each service its own and nothing else) is the whole credential: the service connects with it
(`CRUCIBLE_NATS_NKEY_FILE`), and the server holds only the public keys (`server/auth.conf`), so its
configuration carries no secret. Seeds are made once per folder and kept: a stack started again on the
same state keeps its identities. `crucible up` writes them into its state folder; for compose and
Kubernetes, `crucible bus identities DIR` writes the same files for the deployment to mount.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nkeys

from crucible.contracts.access import ADMIN, ADMIN_PERMISSIONS, SERVICE_PERMISSIONS, Permissions
from crucible.private import write_private

IDENTITIES: tuple[str, ...] = (*SERVICE_PERMISSIONS, ADMIN)
SEED = "seed.nk"
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
        key = pair.public_key.decode()
    except (OSError, nkeys.ErrInvalidSeed, ValueError) as exc:
        raise ValueError(f"{seed_path} holds no NKey user seed: {type(exc).__name__}") from None
    if not key.startswith("U"):
        raise ValueError(f"{seed_path} holds an NKey seed that is not a user's")
    return key


def ensure_identities(folder: Path) -> dict[str, str]:
    """Every identity's seed in `folder` (made where missing, mode 0600): identity -> public key."""
    keys = {}
    for identity in IDENTITIES:
        path = seed_file(folder, identity)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            write_private(path, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode())
        keys[identity] = public_key(path)
    return keys


def authorization(keys: dict[str, str]) -> dict[str, object]:
    """The nats-server `authorization` block: each public key with its identity's permissions."""
    users = [{"nkey": key, "permissions": permissions(identity).config()} for identity, key in keys.items()]
    return {"authorization": {"users": users}}


def write_server_config(folder: Path) -> Path:
    """Seeds for every identity and `server/auth.conf` (JSON, which nats-server reads as its own format):
    the file to give nats-server."""
    path = folder / SERVER_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(authorization(ensure_identities(folder)), indent=2) + "\n")
    return path
